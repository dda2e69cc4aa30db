"""The drafting heads' step with int8 weights on CPU (`generate(..., heads_int8=True)`, the default with
`compile=True` on a CPU).

A drafted step runs the heads on one hidden state right after the verification forward has swept the CPU caches,
so the heads step costs what its weights weigh, read from memory. `Int8HeadsStep` keeps every weight matrix as int8
with one fp32 scale per output row (symmetric, `scale = max |row| / 127`; about a quarter of the fp32 bytes) and runs
all heads, the projection and each head's top-k in one call of a small C++ kernel (`csrc/int8_heads.cpp`, OpenMP on
PyTorch's thread pool). On CPUs with AVX512-VNNI each input vector is quantised to int16 too (one fp32 scale per
vector, at most 16,383 in magnitude) and the products are summed as exact int32 integers, 16 outputs per vector,
which is faster than fp32 activations (docs/performance.md, "Why the compiled step is fast"). Elsewhere activations
and sums stay fp32.

A batch's rows run in one call (`Int8HeadsStep.rows`): each weight row is read once for up to 4 (head, row)
inputs, and every row's output is bit for bit its lone call's (the same sums in the same order).

Only the drafts can change (each weight moves by at most half a quantisation step): the output is the base's own
whatever the drafts are, since the base verifies every drafted token. How much the drafts change is measured, not
assumed: `hf-bpd bench --methods default,default-fp32-heads` (block efficiency and speed with each) and
`tests/test_int8_heads.py`.

Served: FFN and resblock heads reading the base's hidden state (not sequential "hydra" heads, which feed each
head's argmax to the next), tied to the base's output layer (over a draft vocabulary or the whole vocabulary),
with or without logit soft-capping, fp32 weights, on CPU. Anything else keeps the compiled PyTorch heads step.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import threading
import warnings
import weakref
from pathlib import Path

import torch

from ..hub.locate import cache_dir

_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_heads.cpp"
HEADERS = [Path(__file__).resolve().parent / "csrc" / "vector_exp.h"]  # included by both kernel libraries
# -march=native: the kernel is built on the machine that runs it (the file name carries the CPU's features).
# -ffp-contract=off: a multiply and an add stay two roundings wherever the compiler meets them, so a row's sums do not
# depend on which loop (vectorised or not) computed them. With GCC's default (fused where it chooses) the fp32 path
# (CPUs without AVX512-VNNI: AVX2) can give a batch's rows values differing in the last bit from lone calls.
_CXXFLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fvisibility=hidden",
             "-ffp-contract=off", "-DNDEBUG"]
_lock = threading.Lock()
_library = None
_build_error: str | None = None
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # heads -> {(top_k, weights' versions): step}


def cpu_features() -> str:
    """The machine and its CPU flags (`/proc/cpuinfo`): what a kernel built with `-march=native` depends on."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def kernel_file() -> Path:
    """The built kernel for this source, these flags and this CPU (hashed into the file name)."""
    sources = _SOURCE.read_bytes() + b"".join(header.read_bytes() for header in HEADERS)
    digest = hashlib.sha256(sources + " ".join(_CXXFLAGS).encode() + cpu_features().encode())
    return cache_dir() / "kernels" / f"libhf_bpd_int8_heads-{digest.hexdigest()[:16]}.so"


def compile_library(arguments: list[str], target: Path, what: str, timeout: int = 300) -> Path:
    """Run the C++ compiler (`$CXX`, default g++) with `arguments` into `target` (a partial file, then renamed, so
    concurrent builds never load half a file); a one-line RuntimeError naming `what` when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [os.environ.get("CXX", "g++"), *arguments, "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"compiling {what} failed: {error}") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
        raise RuntimeError(f"compiling {what} failed: {lines[0].strip()}")
    os.replace(partial, target)
    return target


def build_kernel(force: bool = False) -> Path:
    """Compile `csrc/int8_heads.cpp` with the C++ compiler (`$CXX`, default g++) into the cache, once."""
    target = kernel_file()
    if target.exists() and not force:
        return target
    return compile_library([*_CXXFLAGS, str(_SOURCE)], target, _SOURCE.name)


def load_kernel():
    """The kernel as a `ctypes.CDLL` (built on first use), or `None` with the reason in `kernel_error()`."""
    global _library, _build_error
    with _lock:
        if _library is None and _build_error is None:
            try:
                from ..hub.locate import trusted

                lib = ctypes.CDLL(str(trusted(build_kernel())))
            except (OSError, RuntimeError) as error:
                _build_error = str(error).splitlines()[0]
                return None
            ptr, cint = ctypes.c_void_p, ctypes.c_int
            lib.bpd_int8_heads_new.argtypes = [cint, cint, cint, cint, cint, cint, ptr, ptr, ptr, ptr, ptr, ptr,
                                               ctypes.c_float]
            lib.bpd_int8_heads_new.restype = ptr
            lib.bpd_int8_heads_free.argtypes = [ptr]
            lib.bpd_int8_heads_free.restype = None
            lib.bpd_int8_heads_run_rows.argtypes = [ptr, ptr, cint, cint, ptr, ptr, cint, cint]
            lib.bpd_int8_heads_run_rows.restype = None
            _library = lib
        return _library


def kernel_error() -> str | None:
    return _build_error


def quantizes_inputs() -> bool:
    """Whether this machine's kernel quantises its inputs to int16 as well (CPUs with AVX512-VNNI; see the module
    docstring)."""
    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(cpu_features().split())


INPUT_LEVELS = 16383  # an input vector's largest magnitude after quantisation (`quantizes_inputs`)


def quantize_input(x: torch.Tensor) -> torch.Tensor:
    """The values the kernel multiplies by for the input vectors `x (..., n)` where it quantises them: each vector
    rounded to multiples of its own `max |x| / INPUT_LEVELS` (fp32)."""
    x = x.float()
    top = x.abs().amax(-1, keepdim=True)
    scale = torch.where(top > 0, top / INPUT_LEVELS, torch.ones_like(top))
    return torch.round(x * (1 / scale)) * scale


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: `(int8 (rows, cols), fp32 scale (rows,))`, `weight ≈ q * scale[:, None]`."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # quantised from their fp32 values (bf16 converts exactly)


def unsupported_reason(heads) -> str | None:
    """Why `Int8HeadsStep` cannot run `heads` (None when it can)."""
    config = heads.config
    if heads.sequential:
        return "sequential (hydra) heads feed each head's argmax to the next"
    if config.head_type not in ("ffn", "resblock"):
        return f"head_type {config.head_type!r}"
    params = list(heads.parameters())
    if any(p.device.type != "cpu" for p in params) or heads._output_embeddings[0].weight.device.type != "cpu":
        return "the heads are not on the CPU"
    if any(p.dtype not in _WEIGHT_DTYPES for p in params):
        return "the heads' weights are neither float32 nor bfloat16"
    if heads.heads[0].projection is not None:
        return "the heads have their own output projections"
    output = heads._output_embeddings[0]  # hf_bpd's int8 layers give their dequantised rows (`heads.py`)
    if output.weight.dtype not in _WEIGHT_DTYPES and not hasattr(output, "dequantized_weight"):
        return "the base's output layer is neither float32, bfloat16 nor hf_bpd's int8"
    return None


def weights_version(heads) -> tuple:
    """Changes when any weight the step quantises changes (in-place updates bump a tensor's `_version`)."""
    weight = heads._output_embeddings[0].weight
    return (weight.data_ptr(), weight._version, heads.draft_vocab.data_ptr() if heads.draft_vocab is not None else 0,
            *((p.data_ptr(), p._version) for p in heads.parameters()))


def cached_step(heads, top_k: int) -> Int8HeadsStep:
    """`Int8HeadsStep(heads, top_k)`, quantised once and reused while the heads' weights stay the same."""
    with _lock:
        by_key = _STEPS.setdefault(heads, {})
    key = (top_k, weights_version(heads))
    if key not in by_key:
        for old in [k for k in by_key if k[1] != key[1]]:  # an older version's steps are not needed again
            del by_key[old]
        by_key[key] = Int8HeadsStep(heads, top_k)
    return by_key[key]


def int8_heads_step(heads, top_k: int, warn: bool = True) -> Int8HeadsStep | None:
    """The heads step with int8 weights (`cached_step`), or None when it cannot serve these heads here (with a
    one-line warning if `warn`: the caller then keeps the fp32 heads step)."""
    reason = unsupported_reason(heads)
    if reason is None and load_kernel() is None:
        reason = f"its kernel did not build ({kernel_error()})"
    if reason is None:
        return cached_step(heads, top_k)
    if warn:
        warnings.warn(f"hf_bpd: heads_int8 is not used ({reason}); drafting with the heads' own weights",
                      stacklevel=4)
    return None


class Int8HeadsStep:
    """`(hidden (hidden_size,), next token) -> (log-probabilities, draft-vocabulary indices)`, `(num_heads, top_k)`
    each, best first: the compiled heads step's contract, with int8 weights. The weights are quantised once (from
    the heads as they are now); `top_k` is the lattice width the caller reads."""

    def __init__(self, heads, top_k: int):
        reason = unsupported_reason(heads)
        if reason is not None:
            raise ValueError(f"int8 heads: {reason}")
        lib = load_kernel()
        if lib is None:
            raise RuntimeError(f"int8 heads: {kernel_error()}")
        self.lib = lib
        config = heads.config
        kind = 0 if config.head_type == "ffn" else 1
        self.num_heads = config.num_heads
        self.hidden_size = config.hidden_size
        self.top_k = top_k
        keep = []  # tensors the kernel points into: alive as long as this step

        def hold(t: torch.Tensor | None):
            if t is None:
                return None
            t = t.detach().contiguous()
            keep.append(t)
            return t.data_ptr()

        weights, scales, biases = [], [], []
        with torch.no_grad():
            for head in heads.heads:
                for block in head.blocks:
                    for linear in ((block.up, block.down) if kind == 0 else (block.linear,)):
                        q, s = quantize_rows(linear.weight)
                        weights.append(hold(q))
                        scales.append(hold(s))
                        biases.append(hold(None if linear.bias is None else linear.bias.float()))
            projection = heads._base_projection_weight().detach()
            bias = heads._base_projection_bias()
            pq, ps = quantize_rows(projection)
        width = (config.head_intermediate_size or config.hidden_size) if kind == 0 else config.hidden_size
        self.vocab = projection.shape[0]
        if top_k > self.vocab:
            raise ValueError(f"int8 heads: top_k {top_k} over the draft vocabulary ({self.vocab})")
        arrays = [(ctypes.c_void_p * len(x))(*x) for x in (weights, scales, biases)]
        softcap = heads.logit_softcapping or 0.0
        self.handle = lib.bpd_int8_heads_new(
            self.num_heads, config.num_layers_per_head, kind, self.hidden_size, width, self.vocab,
            *[ctypes.cast(a, ctypes.c_void_p) for a in arrays], hold(pq), hold(ps),
            hold(None if bias is None else bias.detach().float()), ctypes.c_float(softcap))
        self._keep, self._arrays = keep, arrays

    def __call__(self, hidden: torch.Tensor, token=None) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.numel() != self.hidden_size:
            raise ValueError(f"int8 heads: a hidden state of {self.hidden_size} values, got {tuple(hidden.shape)}")
        values, indices = self.rows(hidden.reshape(1, self.hidden_size))
        return values[0], indices[0]

    def rows(self, hidden: torch.Tensor, heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step for `n` hidden states `(n, hidden_size)` in one call (a batch's rows, each weight read once for
        several of them): `(values, indices)`, `(n, heads, top_k)` each, row `r` what `self(hidden[r])` gives for
        its first `heads` heads (None: all; a step that verifies fewer depths than there are heads runs only
        theirs)."""
        hidden = hidden.detach()
        if hidden.dtype != torch.float32 or not hidden.is_contiguous():
            hidden = hidden.float().contiguous()
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"int8 heads: hidden states (n, {self.hidden_size}), got {tuple(hidden.shape)}")
        heads = self.num_heads if heads is None else heads
        if not 1 <= heads <= self.num_heads:
            raise ValueError(f"int8 heads: 1 to {self.num_heads} heads, got {heads}")
        n = hidden.shape[0]
        values = torch.empty(n, heads, self.top_k)
        indices = torch.empty(n, heads, self.top_k, dtype=torch.long)
        if n:
            self.lib.bpd_int8_heads_run_rows(self.handle, hidden.data_ptr(), n, self.top_k, values.data_ptr(),
                                             indices.data_ptr(), torch.get_num_threads(), heads)
        return values, indices

    def __del__(self):
        handle, self.handle = getattr(self, "handle", None), None
        if handle:
            self.lib.bpd_int8_heads_free(handle)
