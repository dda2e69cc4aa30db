"""Checkpoint files: where a heads checkpoint is, its heads' safetensors file, and the bundled files it carries."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import BaseModelError, BPDError, CheckpointError
from .locate import hub_endpoint, hub_offline, hub_reachable, locate, looks_like_path

HEADS_WEIGHTS_NAME = "heads.safetensors"
FEATURE_DRAFTER_DIR = "feature_drafter"  # a feature-level drafter beside the heads (`hf_bpd.feature_drafter`)


def resolve_checkpoint_dir(name_or_path: str | os.PathLike, hub_kwargs: dict) -> tuple[Path, bool]:
    """`(directory, downloaded)`: a local directory, else a Hub snapshot of the repo id holding only the files its
    config.json names (one-line error when neither is found; a repo that is neither cached nor reachable, or not
    cached under `HF_HUB_OFFLINE`, fails before any Hub call). `downloaded`: the files came from a Hub repo."""
    path = Path(name_or_path).expanduser() if isinstance(name_or_path, (str, os.PathLike)) else None
    if path is not None and path.is_dir():
        return path, is_hub_snapshot(path)
    if path is not None and (looks_like_path(str(name_or_path)) or path.exists()):
        raise CheckpointError(f"{name_or_path} is not a directory: pass the directory save_pretrained wrote")
    allowed = {k: hub_kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in hub_kwargs}
    if not allowed.get("local_files_only") and "cache_dir" not in allowed:
        try:
            kind, where = locate(name_or_path, "heads checkpoint", aliases=False)
        except BaseModelError as err:
            raise CheckpointError(str(err)) from None
        if kind == "hub-cache":
            return Path(where), True
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        with open(hf_hub_download(str(name_or_path), "config.json", **allowed)) as f:
            patterns = checkpoint_files(json.load(f))
        return Path(snapshot_download(str(name_or_path), allow_patterns=patterns, **allowed)), True
    except Exception as err:  # noqa: BLE001 - any Hub failure becomes one actionable line
        raise CheckpointError(
            f"could not find heads {name_or_path!r} locally or on the Hub ({type(err).__name__}): pass a local "
            "directory written by save_pretrained"
        ) from None


def leaves_checkpoint(relative: str) -> bool:
    """Whether a name from config.json points outside the checkpoint (absolute, or through `..`), judged lexically:
    Hub snapshots hold symbolic links."""
    return Path(relative).is_absolute() or ".." in Path(relative).parts


def is_hub_snapshot(directory: Path) -> bool:
    """Whether `directory` is (inside) a Hub cache snapshot, `.../models--<org>--<name>/snapshots/<revision>/`."""
    def inside_snapshot(parts) -> bool:
        return any(a.startswith("models--") and b == "snapshots" for a, b in zip(parts, parts[1:]))

    return inside_snapshot(directory.absolute().parts) or inside_snapshot(directory.resolve().parts)


def checkpoint_files(config: dict) -> list[str]:
    """The files `from_pretrained` reads, as the Hub's `allow_patterns`: the configs, the heads and, inside the
    folders config.json names, JSON and safetensors only (never pickles or code). Names that leave the checkpoint
    match nothing here and fail later with `hub.bundled.inside`'s error."""
    patterns = ["config.json", "generation_config.json", HEADS_WEIGHTS_NAME,
                f"{FEATURE_DRAFTER_DIR}/*.json", f"{FEATURE_DRAFTER_DIR}/*.safetensors"]
    rescorers = config.get("rescorers") if isinstance(config.get("rescorers"), dict) else {}
    named = [spec.get("path") for spec in rescorers.values() if isinstance(spec, dict)] + [config.get("base_adapter")]
    for name in named:
        if isinstance(name, str) and name and not leaves_checkpoint(name):
            patterns += [name, f"{name}/*.json", f"{name}/*.safetensors"]
    return patterns


def check_heads_header(directory: Path, config):
    """Compare the heads `config` describes with the tensors `heads.safetensors` holds, from the file's header only
    and before anything is allocated or the base is loaded: a config that asks for other (say huge) heads than the
    weights hold fails here in milliseconds, with one line. Returns `config`."""
    from ..heads import DraftHeads

    path = directory / HEADS_WEIGHTS_NAME
    if not path.exists():
        return config  # `load_heads_state` says what is missing
    try:
        with safe_open(str(path), "pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupt or not a safetensors file ({str(err).splitlines()[0]}): "
                              "save the heads again with model.save_pretrained(dir)") from None
    config.validate_heads()
    with torch.device("meta"):  # shapes only: nothing is allocated, whatever the config says
        hidden, vocab = int(config.hidden_size), int(config.vocab_size)
        heads = DraftHeads(config, torch.nn.Linear(hidden, vocab, bias=False), torch.nn.Embedding(vocab, hidden))
    expected = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    if config.draft_vocab is not None:  # an older layout: the draft vocabulary in config.json
        stored.setdefault("draft_vocab", (len(config.draft_vocab),))
    wrong = sorted(k for k in expected if k in stored and stored[k] != expected[k])
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if wrong or missing or unexpected:
        detail = (f"shape of {wrong[0]} is {stored[wrong[0]]}, config says {expected[wrong[0]]}" if wrong
                  else f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}")
        raise CheckpointError(f"{path} disagrees with its config.json ({detail}): the config and weights were not "
                              "saved together; save them again with model.save_pretrained(dir)")
    return config


def load_heads_state(directory: Path, heads, legacy_draft_vocab: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The heads' state dict from `heads.safetensors`, checked against the heads built from `config.json`.

    Checkpoints written before the draft vocabulary moved into this file keep it in config.json
    (`legacy_draft_vocab`)."""
    path = directory / HEADS_WEIGHTS_NAME
    if not path.exists():
        raise CheckpointError(f"no {HEADS_WEIGHTS_NAME} in {directory}: save the heads with "
                              "model.save_pretrained(dir) (only safetensors are read)")
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupt or not a safetensors file ({str(err).splitlines()[0]}): "
                              "save the heads again with model.save_pretrained(dir)") from None
    expected = heads.state_dict()
    if "draft_vocab" in expected and "draft_vocab" not in state and legacy_draft_vocab is not None:
        state["draft_vocab"] = torch.tensor(legacy_draft_vocab, dtype=torch.long)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"shape of {wrong[0]} is {tuple(state[wrong[0]].shape)}, config says "
                  f"{tuple(expected[wrong[0]].shape)}")
        raise CheckpointError(f"{path} disagrees with its config.json ({detail}): the config and weights were not "
                              "saved together; save them again with model.save_pretrained(dir)")
    vocab = state.get("draft_vocab")
    size = heads.config.vocab_size
    if vocab is not None and size is not None and (vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= size
                                                   or vocab.unique().numel() != vocab.numel()):
        raise CheckpointError(f"{path} holds a draft vocabulary that is not a set of distinct ids of the base's "
                              f"{size}-token vocabulary: the heads belong to another base")
    return {k: v.to(dtype=expected[k].dtype, device=expected[k].device) for k, v in state.items()}


def copy_bundled(source: Path, target: Path) -> None:
    """Copy a bundled file or directory into a checkpoint being saved (nothing to do when it is already there)."""
    if source.resolve() == target.resolve():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        shutil.copy2(source, target)


def push_saved(save, repo_id: str, private=None, token=None, revision=None, **upload) -> object:
    """`save(tmp_dir)`, then upload that folder to the Hub repo `repo_id` (created if needed)."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi(token=token, endpoint=hub_endpoint())
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    except Exception as err:  # the Hub client's connection errors differ between its versions
        offline = hub_offline()
        if offline or not hub_reachable():
            raise BPDError(f"push_to_hub({repo_id!r}): the Hub ({hub_endpoint()}) cannot be reached"
                           f"{' (HF_HUB_OFFLINE is set)' if offline else ''}: connect and retry, or "
                           "save_pretrained(directory) now and upload that folder later") from err
        raise
    with tempfile.TemporaryDirectory() as tmp:
        save(tmp)
        return api.upload_folder(repo_id=repo_id, folder_path=tmp, revision=revision, **upload)


def save_checkpoint(model, directory: Path) -> None:
    """What `save_pretrained` writes: config, generation config, heads (safetensors), bundled files, remote code and
    model card; never the base's weights."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in model.heads.state_dict().items()}
    save_file(state, directory / HEADS_WEIGHTS_NAME, metadata={"format": "pt", "library": "hf_bpd"})
    if getattr(model, "feature_drafter", None) is not None:
        model.feature_drafter.save(directory / FEATURE_DRAFTER_DIR)
    for name, source in model._bundle_sources.items():
        relative = model.config.base_adapter if name == "base_adapter" else model.config.rescorers[name]["path"]
        copy_bundled(source, directory / relative)
    from .model_card import write_model_card
    from .remote_code import write_remote_code

    write_remote_code(model, directory)  # loads with plain transformers: auto_map + self-contained code
    write_model_card(model, directory)
