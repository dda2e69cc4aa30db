"""The GEMM register block of the one-token batch step (`hf_bpd.runtime.register_block`): the chosen block is the one
in the generated kernel, the results are the same bit for bit, and it is chosen on AVX2 CPUs only."""

import re

import pytest
import torch
import torch._inductor.config as inductor_config

from hf_bpd.runtime import artifacts, inlining, register_block
from tests.test_inlining import _Stack

pytestmark = pytest.mark.autotune  # the GEMM templates only run where inductor autotunes (see tests/conftest.py)


def _fp32_blocks() -> list[tuple[int, int, int]]:
    """This CPU's fp32 register blocks in inductor's table, in its order."""
    table, kernel, isa = register_block._micro_gemm()
    return [tuple(c.register_blocking) for c in table[kernel]
            if register_block._serves(c, isa) and register_block._fp32(c)]


def _compiled(module, x, block=None):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(module, dynamic=False)
    with torch.no_grad(), inductor_config.patch(inlining.INDUCTOR_OPTIONS), \
            register_block.register_block(block) as applied:
        out, code = run_and_get_code(compiled, x)
    torch._dynamo.reset()
    return out, "\n".join(code), applied


def _kernel_blocks(code: str) -> set[tuple[int, int]]:
    return {(int(m), int(n)) for m, n in re.findall(r"_kernel<(\d+), (\d+), accum", code)}


def test_the_register_block_is_the_generated_kernels_and_changes_no_bit(one_thread):
    """16 rows (a batch of 16, one token each): inductor's own block, then each other fp32 block of this CPU's
    instruction set forced: the kernel code uses the forced block and the outputs are equal bit for bit."""
    blocks = _fp32_blocks()
    if len(blocks) < 2:
        pytest.skip("inductor has one fp32 register block for this CPU")
    module = _Stack().eval()
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(3))
    reference, code, applied = _compiled(module, x)
    assert not applied and "gemm" in code  # the GEMM template ran, not only a library call
    own = _kernel_blocks(code)
    assert own, "no micro-kernel in the generated code"
    for block in blocks:
        if block[:2] in own:
            continue
        out, code, applied = _compiled(module, x, block)
        assert applied and block[:2] in _kernel_blocks(code)
        assert torch.equal(out, reference)
    torch.testing.assert_close(reference, module(x), rtol=1e-5, atol=1e-5)


def test_a_block_not_in_the_table_changes_nothing():
    table, kernel, _ = register_block._micro_gemm()
    before = list(table[kernel])
    for block in (None, (3, 5, 7)):
        with register_block.register_block(block) as applied:
            assert not applied and table[kernel] == before
    blocks = _fp32_blocks()
    if len(blocks) < 2:  # dropping the other blocks needs at least two
        pytest.skip(f"inductor has {len(blocks)} fp32 register block(s) for this CPU's instruction set")
    block = blocks[-1]
    with register_block.register_block(block) as applied:
        assert applied and len(table[kernel]) < len(before)
    assert table[kernel] == before  # restored


def test_an_amx_cpu_is_served_by_the_avx512_fp32_blocks():
    """inductor matches a micro-kernel to the CPU by subclass: an AMX CPU runs the AVX-512 fp32 kernels, so the
    blocks this module may force there are those (none would be found by comparing classes for identity)."""
    from torch._inductor.cpu_vec_isa import VecAMX, VecAVX2, VecAVX512

    table, kernel, _ = register_block._micro_gemm()
    avx512 = [c for c in table[kernel] if c.vec_isa_cls is VecAVX512 and register_block._fp32(c)]
    assert avx512, "inductor's table has no AVX-512 fp32 micro-kernel"
    assert all(register_block._serves(c, VecAMX) for c in avx512)
    assert not any(register_block._serves(c, VecAVX2) for c in avx512)


def test_the_batch_steps_get_8x8_on_avx2_only(monkeypatch):
    """AVX2 (no AVX-512): 8 x 8, recorded in the batch steps' keys (so a step built with inductor's choice is built
    again); other instruction sets and `HF_BPD_OFF=register-block`: inductor's choice, nothing recorded."""
    key = {"format": artifacts.FORMAT}
    for capability, block in (("AVX2", (8, 8, 1)), ("AVX512", None), ("DEFAULT", None)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        assert register_block.batch_step_block() == block
        for graph in artifacts.BATCH_GRAPHS:
            assert artifacts.graph_key(key, graph).get("register_block") == ("8x8" if block else None)
        assert artifacts.graph_key(key) == key  # the step: inductor's choice everywhere
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv("HF_BPD_OFF", "register-block")
    assert register_block.batch_step_block() is None
    assert "register_block" not in artifacts.graph_key(key, artifacts.ONE_TOKEN)
