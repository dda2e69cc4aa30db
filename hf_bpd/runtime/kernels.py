"""hf_bpd's PyTorch operators for bf16 and int8-weight bases on CPUs with AVX512-BF16, or AVX2 and FMA
(`torch.ops.hf_bpd_kernels`):

* `packed_linear(x, packed, scale, bias)`: the row-invariant GEMM of `hf_bpd.runtime.packed_linear`
  (`csrc/packed_linear.cpp`), on AMX tiles where the CPU has them; `packed_linear_engine(choose=None)` names (or,
  for tests and benchmarks, sets) the engine of this process: "amx" or "avx512" (`csrc/packed_linear.cpp`), or
  "avx2" on CPUs without AVX512-BF16 (`csrc/packed_linear_avx2.cpp`: the same layout and rounding points, its own
  sums);
* `ordered_attention(query, key, value, mask, key_slots, scaling)`: position-ordered attention over the cache slots
  in use (`hf_bpd.runtime.ordered_attention`, `csrc/ordered_attention.cpp`, or `csrc/ordered_attention_avx2.cpp`).

Both compute each row of a block by the same instructions in the same order as that row alone, which is what keeps
drafting exact in half precision. They are built on first use with the C++ compiler against PyTorch's headers
(once, cached per source, flags, CPU and PyTorch version) and registered with fake (meta) implementations, so
`torch.compile` traces them as opaque calls. `HF_BPD_OFF=kernels` turns them off (inductor's kernels run instead).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch

from ..hub.locate import cache_dir
from .int8_heads import HEADERS, compile_library, cpu_features

_CSRC = Path(__file__).resolve().parent / "csrc"
# the sources by instruction set, the widest first: a CPU builds the first set whose features it has
_SOURCES = {"avx512_bf16": [_CSRC / "packed_linear.cpp", _CSRC / "ordered_attention.cpp"],
            "avx2": [_CSRC / "packed_linear_avx2.cpp", _CSRC / "ordered_attention_avx2.cpp"]}
_FEATURES = {"avx512_bf16": {"avx512f", "avx512_bf16"}, "avx2": {"avx2", "fma", "f16c"}}
_INPUTS = _CSRC / "kernel_inputs.h"  # the operators' checked inputs, included by every source
_CXXFLAGS = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-DNDEBUG", "-w"]
LANES = 16  # outputs per packed weight block (`packed_linear`)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": True, or "error": the reason


def _torch_flags() -> list[str]:
    from torch.utils import cpp_extension

    libdir = str(Path(torch.__file__).resolve().parent / "lib")
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-I", path)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [abi, *includes, "-L", libdir, "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{libdir}"]


def instruction_set() -> str | None:
    """The kernels' instruction set on this CPU ("avx512_bf16" or "avx2"), or None when it has neither."""
    flags = set(cpu_features().split())
    return next((name for name, needed in _FEATURES.items() if needed <= flags), None)


def kernel_file() -> Path:
    """The built library for these sources, flags, this CPU and this PyTorch (hashed into the file name)."""
    key = b"".join(source.read_bytes() for source in (*_SOURCES.get(instruction_set(), []), _INPUTS, *HEADERS))
    key += " ".join(_CXXFLAGS).encode() + cpu_features().encode() + torch.__version__.encode()
    return cache_dir() / "kernels" / f"libhf_bpd_kernels-{hashlib.sha256(key).hexdigest()[:16]}.so"


def _build() -> Path:
    target = kernel_file()
    if target.exists():
        return target
    sources = map(str, _SOURCES[instruction_set()])
    return compile_library([*_CXXFLAGS, *sources, *_torch_flags()], target, "hf_bpd's kernels", timeout=600)


def kernels_unsupported_reason() -> str | None:
    """Why the kernels cannot run here (None when they can; builds and loads them on the first call)."""
    from ..environment import off

    if off("kernels"):
        return "HF_BPD_OFF=kernels"
    with _lock:
        if "loaded" not in _state and "error" not in _state:
            if instruction_set() is None:
                _state["error"] = "this CPU has neither AVX512-BF16 nor AVX2 and FMA instructions"
            else:
                try:
                    from ..hub.locate import trusted

                    torch.ops.load_library(str(trusted(_build())))
                    _register_fakes()
                    _state["loaded"] = True
                except (OSError, RuntimeError) as error:
                    _state["error"] = str(error).splitlines()[0]
        return _state.get("error")


def _register_fakes() -> None:
    @torch.library.register_fake("hf_bpd_kernels::packed_linear")
    def _(x, packed, scale, bias):
        return x.new_empty((*x.shape[:-1], packed.shape[0] * LANES))

    @torch.library.register_fake("hf_bpd_kernels::ordered_attention")
    def _(query, key, value, mask, key_slots, scaling):
        batch, heads, rows, dim = query.shape
        return query.new_empty((batch, rows, heads, dim))
