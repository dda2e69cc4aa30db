"""What a heads checkpoint holds besides the heads: its config, the rescorers bundled with it (`rescorers/` +
`config.json`'s `rescorers`) and an optional LoRA adapter merged into the base (`base_adapter`). Paths in config.json
name files inside the checkpoint directory only.

Bundled rescorers load on first use, so `from_pretrained` parses nothing but JSON and safetensors. A file that native
code parses (a KenLM binary) is read from a Hub download only when its sha256 is pinned outside that repo: by
hf_bpd's list of the files of the checkpoints it publishes (`packaged/bundled_files.txt`), or by the caller
(`from_pretrained(..., trust_bundled_files=True)`, which accepts the hashes in the repo's config.json). A local
directory is the user's own: its config.json's hashes are a corruption check."""

from __future__ import annotations

from collections.abc import MutableMapping
from functools import lru_cache
from pathlib import Path

from ..configuration import BlockwiseParallelConfig
from ..errors import CheckpointError
from ..rescorers.registry import rescorer_class
from .checkpoints import FEATURE_DRAFTER_DIR, leaves_checkpoint


def inside(directory: Path, relative, field: str) -> Path:
    """`directory / relative`, refusing paths that leave the checkpoint (absolute, `..`): config.json names files
    inside its own directory only."""
    if not isinstance(relative, str) or not relative:
        raise CheckpointError(f"{directory / 'config.json'}: {field} must be a file name inside the checkpoint, got "
                              f"{relative!r}: restore config.json")
    if leaves_checkpoint(relative):
        raise CheckpointError(f"{directory / 'config.json'}: {field}={relative!r} points outside the checkpoint "
                              f"directory: restore config.json")
    return directory / relative


def load_heads_config(directory: Path) -> BlockwiseParallelConfig:
    """The checkpoint's `config.json`, with a one-line error when it is missing or not a heads config."""
    if not (directory / "config.json").exists():
        raise CheckpointError(f"no config.json in {directory}: pass a directory written by "
                              "BlockwiseParallelForCausalLM.save_pretrained")
    try:
        return BlockwiseParallelConfig.from_pretrained(directory)
    except (OSError, ValueError, TypeError, KeyError) as err:  # invalid JSON, a tampered or foreign config
        message = " ".join(str(err).split())[:300] or type(err).__name__
        raise CheckpointError(f"{directory / 'config.json'} is not a valid heads config ({message}): restore "
                              "it, or save the heads again with model.save_pretrained(dir)") from None


def merge_base_adapter(base_model, adapter: Path):
    """The base with the checkpoint's LoRA adapter merged in (peft), or a one-line error."""
    from peft import PeftModel

    from ..rescorers.neural import quiet_peft

    if not (adapter / "adapter_model.safetensors").is_file():
        raise CheckpointError(f"the base adapter {adapter} holds no adapter_model.safetensors (only safetensors are "
                              "read): save it again with save_pretrained, or remove base_adapter from config.json")
    try:
        with quiet_peft():
            return PeftModel.from_pretrained(base_model, adapter).merge_and_unload()
    except Exception as err:  # noqa: BLE001 - peft / safetensors raise many kinds
        raise CheckpointError(f"the base adapter {adapter} cannot be loaded ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]}): restore it, or remove base_adapter "
                              "from config.json") from None


def bundle_fields(name: str, path: Path, fields: dict) -> dict:
    """`fields` completed with what config.json records of a rescorer file: its sha256 (checked on every load) and,
    for an n-gram, the vocabulary size it was built for."""
    fields = dict(fields)
    if path.is_file() and "sha256" not in fields:
        from ..rescorers.kenlm import file_sha256

        fields["sha256"] = file_sha256(path)
    if name == "ngram" and "vocab_size" not in fields:
        from ..rescorers.ngram import _read_info

        if _read_info(path).get("vocab_size") is not None:
            fields["vocab_size"] = int(_read_info(path)["vocab_size"])
    return fields


def attach_rescorer(model, name: str, path: Path, spec: dict, trusted: bool = True) -> None:
    """Attach the rescorer `name` stored at `path` to `model`, loaded on first use (`bundle_rescorer`, and
    `from_pretrained` for the config's): `generate(rescorer=name)` uses it, `save_pretrained` copies its file into
    `rescorers/`."""
    if not path.exists():
        raise CheckpointError(f"bundled {name} rescorer {path} is missing: rebuild it or remove it from "
                              "config.json's 'rescorers'")
    alpha = spec.get("alpha", 1.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise CheckpointError(f"the bundled {name} rescorer's alpha must be a number >= 0, got {alpha!r}: fix "
                              "config.json's 'rescorers' (hf-bpd tune-alpha --save writes it)")
    spec = {**spec, "alpha": float(alpha)}
    rescorer_class(name)  # an unknown name fails here, not at the first generate()
    model.bundled_rescorers.defer(name, lambda: _load_rescorer(model.base_lm, name, path, spec, trusted))
    model._bundle_sources[name] = path
    model.config.rescorers[name] = {"path": f"rescorers/{path.name}", **spec}


def _load_rescorer(base_model, name: str, path: Path, spec: dict, trusted: bool):
    cls = rescorer_class(name)
    if cls.parses_natively and not trusted:
        from ..rescorers.kenlm import file_sha256

        if file_sha256(path) not in pinned_files():
            raise CheckpointError(f"the {name} rescorer's {path.name} came from the Hub and native code would parse "
                                  "it, but only that repo vouches for its sha256: if you trust the repo, load it with "
                                  "from_pretrained(..., trust_bundled_files=True), or pass rescorer=None")
    try:
        return cls.from_bundle(base_model, path, **spec)
    except TypeError as err:  # a field the rescorer does not take (a tampered or foreign config)
        raise CheckpointError(f"config.json's 'rescorers.{name}' holds a field the {name} rescorer does not take "
                              f"({err}): remove it") from None


@lru_cache(maxsize=1)
def pinned_files() -> frozenset[str]:
    """sha256 of the bundled files of the checkpoints hf_bpd publishes (`packaged/bundled_files.txt`)."""
    lines = (Path(__file__).parent / "packaged" / "bundled_files.txt").read_text().splitlines()
    return frozenset(line.split()[0] for line in lines if line.strip() and not line.startswith("#"))


class BundledRescorers(MutableMapping):
    """name -> Rescorer, each bundled one loaded (and trust-checked) when first asked for."""

    def __init__(self):
        self._loaded, self._pending = {}, {}

    def defer(self, name: str, load) -> None:
        self._loaded.pop(name, None)
        self._pending[name] = load

    def __getitem__(self, name):
        if name in self._pending:
            self._loaded[name] = self._pending[name]()
            del self._pending[name]
        return self._loaded[name]

    def __setitem__(self, name, rescorer):
        self._pending.pop(name, None)
        self._loaded[name] = rescorer

    def __delitem__(self, name):
        if self._pending.pop(name, None) is None:
            del self._loaded[name]

    def __contains__(self, name):  # without loading
        return name in self._loaded or name in self._pending

    def __iter__(self):
        return iter([*self._loaded, *self._pending])

    def __len__(self):
        return len(self._loaded) + len(self._pending)


def load_bundled(model, directory: Path, trusted: bool) -> None:
    """Attach what a checkpoint bundles besides its heads: its rescorers (loaded on first use; `trusted`: files
    native code parses may be read on the checkpoint's own hashes) and a feature-level drafter (safetensors)."""
    for name, spec in model.config.rescorers.items():
        attach_rescorer(model, name, inside(directory, spec["path"], f"rescorers.{name}.path"),
                        {k: v for k, v in spec.items() if k != "path"}, trusted)
    if (directory / FEATURE_DRAFTER_DIR / "drafter.safetensors").is_file():
        model.load_feature_drafter(directory / FEATURE_DRAFTER_DIR)


def load_feature_drafter(base, folder: Path):
    """The `FeatureDrafter` saved in `folder` (`drafter.safetensors`) for `base`, on its device and in its dtype."""
    from ..feature_drafter import FeatureDrafter

    if not (folder / "drafter.safetensors").is_file():
        raise CheckpointError(f"no drafter.safetensors in {folder}: pass the folder training/train_drafter.py wrote")
    return FeatureDrafter.load(folder, base).to(device=base.device, dtype=base.dtype)
