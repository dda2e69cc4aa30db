"""Remote code for heads checkpoints: `AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)`
loads the base and the heads, and `generate()` drafts with them, where hf_bpd is not installed.

`write_remote_code` writes three self-contained files (torch, transformers and safetensors only) into a checkpoint:

- `configuration_bpd.py` and `modeling_bpd.py`, from the templates in `hf_bpd/hub/remote/`;
- `heads_bpd.py`: the text of `hf_bpd/heads.py` itself, its config import pointed at `configuration_bpd` and the
  cache name (`hf_bpd/kv_cache.py`) inlined, so the
  checkpoint's heads are the same code as hf_bpd's (transformers' dynamic-module loader follows relative imports).

The config then names them (`auto_map`) and records where the remote code loads the base from (`base_model_hub_id`).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from ..errors import CheckpointError
from .base_models import PACKAGED_MODELS

REMOTE_TEMPLATES = Path(__file__).with_name("remote")
HEADS_SOURCE = Path(__file__).resolve().parents[1] / "heads.py"
AUTO_MAP = {
    "AutoConfig": "configuration_bpd.BlockwiseParallelConfig",
    "AutoModelForCausalLM": "modeling_bpd.BlockwiseParallelForCausalLM",
}
# What the remote files may import: the checkpoint must load with these installed and nothing else.
ALLOWED_IMPORTS = {"__future__", "dataclasses", "functools", "hashlib", "json", "os", "warnings", "typing", "math",
                   "torch", "transformers", "safetensors"}
_HEADS_IMPORT = "from .configuration import BlockwiseParallelConfig"
_CACHE_IMPORT = "from .kv_cache import CACHE_NAME  # noqa: F401 - re-exported"
KV_CACHE_SOURCE = HEADS_SOURCE.with_name("kv_cache.py")


def base_model_hub_id(name_or_path: str | os.PathLike | None) -> str | None:
    """Where the remote code loads the base from: a packaged alias's Hub id (the GGUF package is hf_bpd's), else the
    local directory or Hub id as hf_bpd names it."""
    if name_or_path is None:
        return None
    name = str(name_or_path)
    return PACKAGED_MODELS[name].hub_id if name in PACKAGED_MODELS else name


def remote_config_fields(model_or_config) -> dict:
    """The config.json fields the remote code needs: `{"auto_map": ..., "base_model_hub_id": ...}` (set them on the
    config before saving it, or let `write_remote_code` add them to a saved config.json)."""
    config = getattr(model_or_config, "config", model_or_config)
    return {"auto_map": dict(AUTO_MAP), "base_model_hub_id": base_model_hub_id(config.base_model_name_or_path)}


def heads_source() -> str:
    """`hf_bpd/heads.py` as the checkpoint's `heads_bpd.py`: the same code, importing the remote config."""
    text = HEADS_SOURCE.read_text(encoding="utf-8")
    if text.count(_HEADS_IMPORT + "\n") != 1:
        raise CheckpointError(f"{HEADS_SOURCE} no longer imports its config as `{_HEADS_IMPORT}`: update "
                              "hf_bpd.hub.remote_code.heads_source")
    if text.count(_CACHE_IMPORT + "\n") != 1:
        raise CheckpointError(f"{HEADS_SOURCE} no longer imports `{_CACHE_IMPORT}`: update "
                              "hf_bpd.hub.remote_code.heads_source")
    # The cache name is inlined (the checkpoint has no kv_cache module): kv_cache.py's code, its import included.
    code = [line for line in KV_CACHE_SOURCE.read_text(encoding="utf-8").splitlines()
            if line.startswith(("from ", "import ", "CACHE_NAME = "))]
    text = text.replace(_HEADS_IMPORT + "\n", "from .configuration_bpd import BlockwiseParallelConfig\n")
    text = text.replace(_CACHE_IMPORT + "\n", "\n".join(code) + "\n")
    return "# Copied from hf_bpd/heads.py by hf_bpd.hub.remote_code.write_remote_code: edit that file.\n" + text


def remote_files() -> dict[str, str]:
    """`{file name: source}` of the remote code, each checked to import only `ALLOWED_IMPORTS` and its siblings."""
    files = {name: (REMOTE_TEMPLATES / name).read_text(encoding="utf-8")
             for name in ("configuration_bpd.py", "modeling_bpd.py")}
    files["heads_bpd.py"] = heads_source()
    siblings = {name.removesuffix(".py") for name in files}
    for name, text in files.items():
        tree = ast.parse(text, filename=name)
        # Optional imports (inside `try:`) are allowed: transformers' import check skips them too.
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in optional:
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                bad = None if node.level == 1 and node.module in siblings else f".{node.module}"
            else:
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                bad = next((m for m in modules if m.split(".")[0] not in ALLOWED_IMPORTS), None)
            if bad is not None:
                raise CheckpointError(f"the remote code's {name} imports {bad}, which a checkpoint cannot rely on: "
                                      "import only torch, transformers, safetensors and the standard library there")
    return files


def add_auto_map(directory: str | os.PathLike, auto_map: dict | None = None, **fields) -> dict:
    """Set `auto_map` (default `AUTO_MAP`) and `fields` in `directory/config.json`; returns the updated config dict."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot add remote code to {path} ({' '.join(str(err).split())[:200]}): save the "
                              "heads first with model.save_pretrained(dir)") from None
    config["auto_map"] = dict(AUTO_MAP if auto_map is None else auto_map)
    config.update(fields)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return config


def write_remote_code(model, directory: str | os.PathLike, update_config: bool = True) -> dict:
    """Write the remote code files into the checkpoint `directory` and return the `auto_map` for its config.json.

    With `update_config` and a config.json already in `directory`, also sets its `auto_map` and `base_model_hub_id`
    (`add_auto_map`); otherwise put `remote_config_fields(model)` into the config before saving it.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in remote_files().items():
        (directory / name).write_text(text, encoding="utf-8")
    fields = remote_config_fields(model)
    if update_config and (directory / "config.json").exists():
        add_auto_map(directory, fields.pop("auto_map"), **fields)
    return dict(AUTO_MAP)
