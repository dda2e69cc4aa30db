"""The register block of inductor's fp32 CPU GEMM micro-kernel, chosen for the batch steps on AVX2 CPUs.

inductor picks the micro-kernel's register block (rows x columns of the output it keeps in registers) by its size
first. On AVX2 that is 4 x 24, so a GEMM over 16 rows (a batch of 16, one token each) passes over every weight panel
four times; its one other fp32 AVX2 block, 8 x 8, passes twice, so a batch step of 8 or more rows runs faster on
8 x 8, and one of fewer rows no slower. The logits are equal bit for bit: the block changes which outputs a kernel
call computes, not the order of any sum. In graphs whose block length is dynamic (the artifact's step, tuned for 8
tokens) 8 x 8 did not pay, so only the graphs beside it get it (`batch_step_block`): the batch steps of one and two
tokens a row (docs/performance.md, "Compiled steps").

inductor has no option for the register block, so while the graph compiles (inside `register_block` only) its list
of fp32 micro-kernel configurations for this CPU's instruction set keeps the chosen block's. The list is inductor's
internal table: where it has no such entry (another instruction set, another torch version), nothing is changed.
`HF_BPD_OFF=register-block` keeps inductor's own choice.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

AVX2_BATCH_STEP_BLOCK = (8, 8, 1)  # (rows, columns, k) of the batch steps' fp32 micro-kernel on AVX2


def _micro_gemm():
    """inductor's micro-kernel table, the fp32 vector kernel class and this CPU's instruction set class."""
    # inductor's own entry first: importing the micro-kernel's module first is a circular import (a new process)
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return cpp_micro_gemm.micro_gemm_configs, cpp_micro_gemm.CppMicroGemmFP32Vec, type(pick_vec_isa())


def batch_step_block() -> tuple[int, int, int] | None:
    """The register block the batch steps (one and two tokens a row) are built with on this CPU: 8 x 8 where the
    CPU's vector capability is AVX2 (no AVX-512), else None (inductor's choice); None with `HF_BPD_OFF=register-block`.
    Read from torch's capability, not inductor's instruction-set probe: every batch step's key asks for it, and
    the probe is slow in a process that has not loaded inductor (where the two disagree, `register_block` finds
    no 8 x 8 entry and changes nothing)."""
    from ..environment import off

    if off("register-block"):
        return None
    return AVX2_BATCH_STEP_BLOCK if torch.backends.cpu.get_cpu_capability() == "AVX2" else None


def _serves(config, isa) -> bool:
    """Whether inductor may pick `config` on a CPU of instruction-set class `isa`: as inductor matches, by subclass
    (an AMX CPU's class derives from AVX-512's and runs its fp32 kernels)."""
    return issubclass(isa, config.vec_isa_cls)


def _fp32(config) -> bool:
    return config.input_dtype == config.input2_dtype == config.output_dtype == torch.float32


@contextlib.contextmanager
def register_block(block: tuple[int, int, int] | None):
    """Inside the block, inductor's fp32 CPU micro-kernels on this CPU's instruction set use the register block
    `block` (see the module docstring); yields whether it applies (False: `block` is None or not in the table)."""
    try:
        table, kernel, isa = _micro_gemm()
        configs = table[kernel]
    except Exception as err:  # noqa: BLE001 - another torch: inductor's choice
        logger.warning("hf_bpd: GEMM register block left to inductor (%s: %s)", type(err).__name__, err)
        configs = None
    if block is None or configs is None:
        yield False
        return
    block = tuple(block)
    mine = [c for c in configs if _serves(c, isa) and _fp32(c)]
    if not any(tuple(c.register_blocking) == block for c in mine):
        yield False
        return
    dropped = {id(c) for c in mine if tuple(c.register_blocking) != block}
    table[kernel] = [c for c in configs if id(c) not in dropped]
    try:
        yield True
    finally:
        table[kernel] = configs
