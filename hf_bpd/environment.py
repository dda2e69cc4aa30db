"""hf_bpd's environment variables, all of them (docs/reliability.md, "Environment variables"):

| variable | what it does |
| --- | --- |
| `HF_BPD_CACHE` | the cache folder (converted bases, artifacts, kernels, KenLM; default `~/.cache/hf_bpd`; empty = unset) |
| `HF_BPD_OFF` | machine-specific paths to turn off, comma-separated, from `PATHS` (e.g. `artifacts,amx`) |
| `HF_BPD_KENLM_BIN` | a folder of KenLM's `lmplz` and `build_binary` to use instead of the cache's |
| `HF_BPD_DEBUG` | `1`: tracebacks instead of one-line errors, and the compilers' own output |

Each machine-specific path is an optimisation with a plain fallback, so turning one off changes speed, never output.
This module imports nothing, so the command line can read it before anything heavy is loaded.
"""

from __future__ import annotations

import os
import warnings

PATHS = {
    "artifacts": "compiled steps built once per machine (`compile=True` then compiles in the process)",
    "kernels": "hf_bpd's C++ kernels for bf16 and int8-weight bases (inductor's GEMMs instead)",
    "amx": "AMX tiles in the packed GEMM (its AVX512-BF16 engine instead)",
    "prefetch": "weight prefetches in inductor's fp32 GEMM micro-kernel",
    "register-block": "the 8 x 8 fp32 GEMM register block of the batch steps on AVX2 CPUs",
}
_WARNED: set[str] = set()


def off(path: str) -> bool:
    """Whether `HF_BPD_OFF` names `path` (one of `PATHS`); an unknown name in it is warned about once."""
    if path not in PATHS:
        raise KeyError(f"no machine-specific path {path!r}: one of {', '.join(PATHS)}")
    names = {name.strip() for name in os.environ.get("HF_BPD_OFF", "").split(",") if name.strip()}
    for name in names - set(PATHS) - _WARNED:
        _WARNED.add(name)
        warnings.warn(f"HF_BPD_OFF names {name!r}, which is none of {', '.join(PATHS)}: ignored", stacklevel=2)
    return path in names
