"""hf_bpd: blockwise parallel decoding with draft refinement for Hugging Face Transformers.

Module map: `configuration` (what the heads are), `heads` (the drafting heads and their loss), `modeling` (the model
class), `lattice` (a step's top-k lattice), `generation/` (options, drafting, draft trees, the decoding loop),
`rescorers/` (registry, n-gram, neural), `training/`, `evaluation/` (analysis, tuning, bench), `hub/` (base models,
checkpoint files, model cards), `cli`.

Every public name is resolved on first use (PEP 562). `import hf_bpd` still imports them all at once -- and so
registers the model type with `AutoConfig` / `AutoModelForCausalLM` -- except inside the `hf-bpd` command, whose
`--help` and input errors must not wait seconds for torch and transformers (it imports what a subcommand needs).
"""

import importlib
import os
import sys

from .errors import (BaseModelError, BPDConfigError, BPDError, BPDTypeError, CheckpointError, InputError,  # noqa: F401
                     WorkLimitError)

__version__ = "0.1.0"

_LAZY = {
    "ALPHA_GRID": "evaluation.tuning", "tune_alpha": "evaluation.tuning",
    "BlockwiseParallelConfig": "configuration",
    "BlockDrafter": "generation", "BlockwiseGenerateOutput": "generation", "BlockwiseGenerationConfig": "generation",
    "GenerationStats": "generation", "sparse_tree": "generation",
    "DraftHeads": "heads",
    "PACKAGED_MODELS": "hub.base_models", "fingerprint": "hub.base_models", "load_base": "hub.base_models",
    "load_base_model": "hub.base_models", "load_tokenizer": "hub.base_models",
    "Draft": "lattice", "Lattice": "lattice",
    "BlockwiseParallelForCausalLM": "modeling", "BlockwiseParallelOutput": "modeling",
    "HeadScoreRescorer": "rescorers", "NeuralRescorer": "rescorers", "NgramRescorer": "rescorers",
    "Rescorer": "rescorers", "available_rescorers": "rescorers", "build_ngram": "rescorers",
    "register_rescorer": "rescorers",
    "bpd_lora_config": "training.lora",
    "Int8WeightsConfig": "runtime.int8_weights", "quantize_int8_weights": "runtime.int8_weights",
}

__all__ = sorted([*_LAZY, "BPDConfigError", "BPDError", "BPDTypeError", "BaseModelError", "CheckpointError",
                  "InputError", "WorkLimitError"])


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_bpd' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    importlib.import_module(".modeling", __name__)  # registers the model type with transformers' Auto classes
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _inside_cli() -> bool:
    """True in the `hf-bpd` console script (the only place where the heavy imports are deferred)."""
    argv = getattr(sys, "argv", None) or [""]
    return os.path.basename(str(argv[0])) in ("hf-bpd", "hf-bpd.exe")


if not _inside_cli():
    for _name in _LAZY:
        __getattr__(_name)
    del _name
