"""Software prefetching in inductor's CPU GEMM micro-kernel, for the compiled verification step.

Why: inductor's fp32 micro-kernel (`CppMicroGemmFP32Vec`, register block 8 x 48) walks the prepacked weights and
leaves the loads to the hardware prefetchers. On CPUs whose cores keep too few reads in flight for it, the arithmetic
of a block of several rows stalls the weight stream: a block of 8 tokens reads the weights markedly slower than one
token does. Asking for each weight row `PREFETCH_ROWS` rows ahead (`__builtin_prefetch`, one per cache line) keeps
the stream going: the 8-row kernel then reads as fast as the 1-row one, which gets faster too, and a compiled block
of 8 tokens is much cheaper (docs/performance.md, "Why the compiled step is fast"); a shorter or a longer
distance helped less. Prefetches never fault and change no arithmetic: the results are bit-identical
(`tests/test_inlining.py`).

inductor has no option for it, so while the compiled step compiles (inside its config patch only: the user's own
`torch.compile` calls are untouched) the micro-kernel's template gets the prefetch line. The template is inductor's
internal text: if the line it is added to is not found exactly once (another torch version), nothing is changed.
`HF_BPD_OFF=prefetch` turns it off.
"""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger(__name__)

PREFETCH_ROWS = 32  # weight rows ahead: 32 x 48 floats = 6 KB ahead in the packed block
_LOAD = "            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);\n"
_PREFETCH = (  # one prefetch per 64-byte line of the row (the column offset is a compile-time constant)
    "            if constexpr ((col * VLEN * sizeof(*B)) % 64 == 0) {\n"
    "                __builtin_prefetch(B + (k + ROWS) * ldb + col * VLEN, 0, 3);\n"
    "            }\n"
)


def prefetch_rows() -> int:
    """The prefetch distance in weight rows: `PREFETCH_ROWS`, 0 (off) with `HF_BPD_OFF=prefetch`."""
    from ..environment import off

    return 0 if off("prefetch") else PREFETCH_ROWS


@contextlib.contextmanager
def prefetching_gemm_template():
    """Inside the block, inductor's fp32 CPU micro-kernel prefetches the weights (see the module docstring)."""
    rows = prefetch_rows()
    try:
        # inductor's own entry first: in a process that has not loaded inductor yet (`hf-bpd compile`, the
        # background builder), importing the micro-kernel's module first is a circular import
        import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec
        template = CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    except Exception as err:  # noqa: BLE001 - another torch: compile without it
        logger.warning("hf_bpd: GEMM weight prefetches off (%s: %s)", type(err).__name__, err)
        template = None
    if not rows or not isinstance(template, str) or template.count(_LOAD) != 1:
        yield False
        return
    CppMicroGemmFP32Vec.TEMPLATE_KERNEL = template.replace(_LOAD, _PREFETCH.replace("ROWS", str(rows)) + _LOAD)
    try:
        yield True
    finally:
        CppMicroGemmFP32Vec.TEMPLATE_KERNEL = template
