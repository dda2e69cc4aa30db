"""hf_bpd's CPU kernels for bf16 and int8-weight bases (`hf_bpd.runtime.kernels`): the packed GEMM and the ordered
attention compute each row of a block bit for bit as that row alone, close to the layers they stand for; the compiled
steps of a bf16 base run them, and its drafted decoding equals its plain decoding token for token."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.runtime import compiled as verify_runtime
from hf_bpd.runtime.int8_weights import Int8WeightLinear
from hf_bpd.runtime.kernels import instruction_set, kernels_unsupported_reason
from hf_bpd.runtime.ordered_attention import ordered_kernel_attention_forward
from hf_bpd.runtime.packed_linear import PackedLinear, packed_base
from tests.conftest import VOCAB
from tests.test_decoding import prompt_ids
from tests.test_ordered_attention import assert_drafting_equals_plain, assert_tree_rows_equal_lone_rows

REASON = kernels_unsupported_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"hf_bpd's kernels: {REASON}"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


CPU_HAS_AMX = "amx_bf16" in open("/proc/cpuinfo").read().split()


def _engines() -> list[str]:
    """The packed GEMM's engines this process can run: AVX512-BF16, and AMX where the CPU has it and Linux grants it;
    AVX2 alone on CPUs without AVX512-BF16."""
    if REASON is not None:
        return ["avx512"]
    if instruction_set() == "avx2":
        return ["avx2"]
    choose = torch.ops.hf_bpd_kernels.packed_linear_engine
    before = choose()
    engines = ["avx512"] + (["amx"] if choose("amx") == "amx" else [])
    choose(before)
    return engines


ENGINES = _engines()


@pytest.fixture(params=ENGINES)
def engine(request):
    """The packed GEMM's engine for one test (AVX512-BF16, and AMX tiles where the CPU has them; or AVX2), restored
    after it."""
    choose = torch.ops.hf_bpd_kernels.packed_linear_engine
    before = choose()
    assert choose(request.param) == request.param
    yield request.param
    choose(before)


def test_the_packed_gemm_runs_on_amx_where_the_cpu_has_it():
    engine = torch.ops.hf_bpd_kernels.packed_linear_engine()
    if instruction_set() == "avx2":  # no AVX512-BF16: the AVX2 kernel, which has no other engine
        assert engine == "avx2"
        with pytest.raises(RuntimeError, match="'avx2' only"):
            torch.ops.hf_bpd_kernels.packed_linear_engine("avx512")
        return
    assert engine == ("amx" if CPU_HAS_AMX and "amx" not in os.environ.get("HF_BPD_OFF", "").split(",") else "avx512")
    with pytest.raises(RuntimeError, match="'amx' or 'avx512'"):
        torch.ops.hf_bpd_kernels.packed_linear_engine("tiles")


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("inputs", [96, 90], ids=["k96", "k90"])
def test_packed_linear_rows_equal_lone_rows_and_the_layer(int8, bias, inputs, engine):
    """Any number of rows (register tiles of 4 and 8, tails of 1-7; AMX tiles of 16 rows, in pairs of tiles sharing each
    weight tile, and a lone last tile; 5 blocks of 16 outputs: pairs of blocks and a lone block): each equals the
    same row alone, bit for bit, and the layer it packs within bf16 rounding. 90 inputs (not whole AMX tiles) take
    the AVX512 path on either engine."""
    torch.manual_seed(0)
    layer = nn.Linear(inputs, 80, bias=bias).to(torch.bfloat16)
    if int8:
        layer = Int8WeightLinear.from_linear(layer)
    packed = PackedLinear.of(layer)
    assert packed is not None
    x = torch.randn(37, inputs).to(torch.bfloat16)
    with torch.no_grad():
        whole = packed(x)
        reference = layer(x)
        for rows in (1, 3, 4, 5, 8, 12, 16, 17, 32, 33, 37):
            block = packed(x[:rows])
            for row in range(rows):
                assert torch.equal(block[row], packed(x[row:row + 1])[0]), (rows, row)
            assert torch.equal(block, whole[:rows])
    torch.testing.assert_close(whole.float(), reference.float(), atol=3e-2, rtol=2e-2)
    assert whole.dtype == torch.bfloat16 and packed(x.reshape(1, 37, inputs)).shape == (1, 37, 80)


def test_packed_linear_serves_only_shapes_it_packs():
    assert PackedLinear.of(nn.Linear(96, 40).to(torch.bfloat16)) is None  # 40 outputs: not a multiple of 16
    assert PackedLinear.of(nn.Linear(95, 32).to(torch.bfloat16)) is None  # odd inputs
    assert PackedLinear.of(nn.Linear(96, 32)) is None  # fp32
    with pytest.raises(RuntimeError, match="x must be bf16"):
        PackedLinear.of(nn.Linear(96, 32).to(torch.bfloat16))(torch.randn(2, 96))


def _kernel(q, k, v, mask, key_slots, key_ranks):
    return ordered_kernel_attention_forward(None, q, k, v, mask, key_slots=key_slots, key_ranks=key_ranks)[0]


def test_kernel_attention_rows_equal_one_token_steps_whatever_the_tree():
    """As `test_compiled_ordered_attention_rows_equal_one_token_steps_whatever_the_tree`, run eagerly: each row of a
    tree block equals a lone query at its position over its own sequence bit for bit, and it is attention."""
    with torch.no_grad():
        for trial in range(3):
            assert_tree_rows_equal_lone_rows(_kernel, trial)


def test_kernel_attention_reads_only_open_slots():
    """Slots closed for every row at the end of the cache are skipped: garbage there changes nothing."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 32, generator=generator).to(torch.bfloat16)
    k = torch.randn(1, 2, 64, 32, generator=generator).to(torch.bfloat16)
    v = torch.randn(1, 2, 64, 32, generator=generator).to(torch.bfloat16)
    mask = torch.zeros(1, 1, 3, 64, dtype=torch.bfloat16)
    mask[..., 20:] = torch.finfo(torch.bfloat16).min
    before = _kernel(q, k, v, mask, None, None)
    k[:, :, 20:] = float("nan")
    v[:, :, 20:] = float("nan")
    assert torch.equal(_kernel(q, k, v, mask, None, None), before)


def test_kernel_attention_reads_each_sequence_of_a_batch_in_its_own_position_order():
    """A batch's sequences on one static cache, each with left padding and holes at other slots
    (`batch_cache.position_order`: its open slots as its positions, `key_slots (batch, rows, slots)`): every query
    row equals the same sequence alone on a cache without holes, slot = position, bit for bit."""
    from hf_bpd.generation.batch_cache import position_order

    generator = torch.Generator().manual_seed(3)
    batch, rows, slots, closed = 3, 2, 256, torch.finfo(torch.bfloat16).min
    k = torch.randn(batch, 2, slots, 32, generator=generator).to(torch.bfloat16)
    v = torch.randn(batch, 2, slots, 32, generator=generator).to(torch.bfloat16)
    q = torch.randn(batch, 4, rows, 32, generator=generator).to(torch.bfloat16)
    open_ = torch.rand(batch, rows, slots, generator=generator) < 0.7  # holes, in a different pattern per row
    open_[:, :, 230:] = False  # the end of the cache: closed for every row
    open_[0, :, :40] = False  # left padding
    open_[:, 1, 229] = True  # the block's second row sees one more slot than the first
    open_[:, 0, 229] = False
    mask = torch.zeros(batch, 1, rows, slots, dtype=torch.bfloat16).masked_fill_(~open_[:, None], closed)
    by_position, key_slots = position_order(mask)
    got = torch.ops.hf_bpd_kernels.ordered_attention(q, k, v, by_position, key_slots, 0.125)
    for b in range(batch):
        for r in range(rows):
            seen = open_[b, r].nonzero().flatten()
            alone_k, alone_v = torch.zeros_like(k[b: b + 1]), torch.zeros_like(v[b: b + 1])
            alone_k[:, :, : len(seen)], alone_v[:, :, : len(seen)] = k[b: b + 1, :, seen], v[b: b + 1, :, seen]
            alone_mask = torch.full((1, 1, 1, slots), closed, dtype=torch.bfloat16)
            alone_mask[..., : len(seen)] = 0
            alone = torch.ops.hf_bpd_kernels.ordered_attention(q[b: b + 1, :, r: r + 1], alone_k, alone_v,
                                                               alone_mask, None, 0.125)
            assert torch.equal(got[b, r], alone[0, 0]), (b, r)


def test_kernel_attention_reads_a_transposed_query_in_place():
    """A block's query reaches the kernel as a transposed view (heads and rows swapped): read through its strides,
    it gives what its contiguous copy gives, bit for bit."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 5, 4, 32, generator=generator).to(torch.bfloat16).transpose(1, 2)  # (1, 4 heads, 5 rows, 32)
    k = torch.randn(1, 2, 64, 32, generator=generator).to(torch.bfloat16)
    v = torch.randn(1, 2, 64, 32, generator=generator).to(torch.bfloat16)
    mask = torch.zeros(1, 1, 5, 64, dtype=torch.bfloat16)
    mask[..., 40:] = torch.finfo(torch.bfloat16).min
    assert not q.is_contiguous()
    strided = torch.ops.hf_bpd_kernels.ordered_attention(q, k, v, mask, None, 0.125)
    assert torch.equal(strided, torch.ops.hf_bpd_kernels.ordered_attention(q.contiguous(), k, v, mask, None, 0.125))


def test_the_packed_base_reads_its_rotary_embeddings_from_a_table(kernel_model):
    """The packed module tree's rotary embeddings are table rows equal to the base's own module's outputs."""
    from hf_bpd.runtime.rotary_table import RotaryTable

    base = kernel_model.base_lm
    clone = packed_base(base)
    assert isinstance(clone.model.rotary_emb, RotaryTable) and not isinstance(base.model.rotary_emb, RotaryTable)
    positions = torch.tensor([[0, 1, 7, 300, base.config.max_position_embeddings - 1]])
    x = torch.zeros(1, dtype=torch.bfloat16)
    for got, want in zip(clone.model.rotary_emb(x, positions), base.model.rotary_emb(x, positions)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _head_dim_16_bpd(hidden_size: int = 32, layers: int = 2):
    """A tiny bf16 Llama whose head dim (`hidden_size / 2`, 16 by default) the attention kernel serves, with random
    heads."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden_size // 2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = BlockwiseParallelForCausalLM.from_base(AutoModelForCausalLM.from_config(config).eval(), num_heads=3)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval().to(torch.bfloat16)


@pytest.fixture(scope="module")
def kernel_model(one_thread):
    model = _head_dim_16_bpd()
    yield model
    verify_runtime.discard_runners(model.base_lm)
    torch._dynamo.reset()


def test_packed_base_shares_the_weights_and_leaves_the_base_as_loaded(kernel_model):
    base = kernel_model.base_lm
    clone = packed_base(base)
    assert packed_base(base) is clone  # one per base
    assert type(base.model.layers[0].mlp.up_proj) is nn.Linear and type(base.lm_head) is nn.Linear
    assert isinstance(clone.model.layers[0].mlp.up_proj, PackedLinear) and isinstance(clone.lm_head, PackedLinear)
    assert clone.model.embed_tokens.weight is base.model.embed_tokens.weight and clone.config is base.config
    assert packed_base(copy.deepcopy(base).float()) is None  # fp32 bases keep their layers
    verify_runtime.discard_runners(base)  # (weights may have changed: the next step packs them afresh)
    assert packed_base(base) is not clone


def test_the_compiled_prompt_pass_runs_the_packed_kernels(kernel_model):
    """The prompt pass of a compiled call runs the packed module tree (plain and drafted decoding share it): its
    logits and hidden state are the packed tree's own, bit for bit, and its keys and values fill the static cache."""
    from hf_bpd.runtime.compiled_verifier import CompiledVerifier

    base = kernel_model.base_lm
    runner = verify_runtime.compiled_runner(base, 64)
    ids = prompt_ids(4, 9)
    with runner.lock, torch.no_grad():
        logits, hidden = CompiledVerifier(kernel_model, runner).prefill(ids)
        want = packed_base(base)(input_ids=ids, output_hidden_states=True)
        assert torch.equal(logits, want.logits[:, -1]) and torch.equal(hidden, want.hidden_states[-1][0, -1])
        assert runner.cache.layers[0].keys[0, :, :9].abs().sum() > 0


def test_compiled_kernel_steps_round_a_tree_block_like_one_token_steps(kernel_model):
    from tests.test_ordered_attention import assert_tree_rows_equal_one_token_steps

    runner = verify_runtime.compiled_runner(kernel_model.base_lm, 64)
    assert runner.packed is not None and runner.attention_kernel
    assert_tree_rows_equal_one_token_steps(kernel_model, runner)


@pytest.mark.parametrize("options", [{}, {"tree": (2, 2, 1)}, {"num_drafts": 3, "draft_top_k": 2, "draft_nodes": 3,
                                                               "prompt_lookup": True}], ids=["chain", "tree", "nodes"])
def test_compiled_kernel_decoding_equals_compiled_plain_decoding(kernel_model, options):
    assert_drafting_equals_plain(kernel_model, options)


def test_the_random_heads_get_drafts_accepted(kernel_model):
    """The fixture's heads draft tokens the base accepts (else the exactness tests above would prove little)."""
    stats = []
    for seed in range(3):
        kernel_model.generate(prompt_ids(seed, 8), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              compile=True, tree=(2, 2, 1))
        stats.append(kernel_model.last_generation_stats.block_efficiency)
    assert max(stats) > 1.0, stats


def test_kernel_benchmark_smoke(tmp_path):
    """`benchmarks/packed_kernels.py` runs, and finds hf_bpd's kernels row-invariant on every SmolLM2 shape (GEMMs and
    attention)."""
    root = Path(__file__).resolve().parents[1]
    output = tmp_path / "kernels.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "packed_kernels.py"), "--repeats", "1", "--threads", "1",
                    "--output", str(output)], check=True, cwd=root, capture_output=True, timeout=600)
    rows = json.loads(output.read_text())["rows"]
    gemms = [row for row in rows if not row["shape"].startswith("attention")]
    assert len(gemms) == 20 and len(rows) == 26
    assert all(row["hf_bpd_bf16_row_invariant"] and row["hf_bpd_int8_row_invariant"] for row in gemms)
    assert all(row.get(f"hf_bpd_{kind}_avx512_row_invariant", True) for row in gemms for kind in ("bf16", "int8"))
    assert all(row["hf_bpd_attention_row_invariant"] for row in rows[20:])
