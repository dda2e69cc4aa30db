"""Int8-weight bases (`hf_bpd.runtime.int8_weights`): the layers, loading, and compiled decoding that equals compiled
plain decoding token for token (inductor's weight-only int8 GEMM templates, position-ordered attention)."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_bpd import BlockwiseParallelForCausalLM, BPDConfigError, Int8WeightsConfig, quantize_int8_weights
from hf_bpd.generation.tree import DraftTree
from hf_bpd.runtime import compiled as verify_runtime
from hf_bpd.runtime.compiled_verifier import CompiledVerifier
from hf_bpd.runtime.int8_weights import Int8WeightLinear, has_int8_weights
from tests.test_decoding import prompt_ids
from tests.test_ordered_attention import assert_drafting_equals_plain, assert_tree_rows_equal_one_token_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def int8_sized_base(seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = 128):
    """A small random Llama whose layer shapes take inductor's small-row int8 kernels (in/out sizes multiples of
    64 and 32), in bf16."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def int8_bpd(seed: int = 0) -> BlockwiseParallelForCausalLM:
    base = int8_sized_base(seed)
    quantize_int8_weights(base)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3)
    generator = torch.Generator().manual_seed(seed + 8)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def int8_model(one_thread):
    model = int8_bpd()
    yield model
    verify_runtime.discard_runners(model.base_lm)
    torch._dynamo.reset()  # dynamo keeps at most MAX_COMPILED_SHAPES graphs of the step's code: leave room for others


def test_int8_layers_hold_int8_rows_and_compute_close_to_the_bf16_layer():
    linear = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    layer = Int8WeightLinear.from_linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.bfloat16
    assert int(layer.weight.abs().max()) == 127  # every row's largest weight uses the full range
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    reference = linear(x).float()
    assert (layer(x).float() - reference).abs().max() <= 0.05 * reference.abs().max()
    assert torch.allclose(layer.dequantized_weight().float(), linear.weight.float(), atol=float(
        layer.weight_scale.float().max()))


def test_dequantized_rows_are_the_whole_expressions_rows_block_by_block():
    """Dequantized a block of rows at a time (no fp32 copy of a whole output layer), and only the rows asked for:
    every value equals the whole-matrix expression's, across a block boundary."""
    from hf_bpd.runtime.int8_weights import DEQUANTIZE_ROWS, float_weight

    torch.manual_seed(0)
    layer = Int8WeightLinear.from_linear(nn.Linear(32, DEQUANTIZE_ROWS + 40, bias=False).to(torch.bfloat16))
    whole = (layer.weight.float() * layer.weight_scale.float()[:, None]).to(torch.bfloat16)
    assert torch.equal(layer.dequantized_weight(), whole) and torch.equal(float_weight(layer), whole)
    rows = torch.tensor([DEQUANTIZE_ROWS + 39, 0, DEQUANTIZE_ROWS, 7])
    assert torch.equal(layer.dequantized_weight(rows), whole[rows])
    assert torch.equal(float_weight(layer, rows), whole[rows])


def test_quantizing_converts_the_decoder_and_output_layers_and_refuses_fp32():
    base = int8_sized_base()
    embeddings = base.get_input_embeddings().weight
    assert quantize_int8_weights(base) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the output layer
    assert has_int8_weights(base) and isinstance(base.lm_head, Int8WeightLinear)
    assert base.get_input_embeddings().weight is embeddings and embeddings.dtype == torch.bfloat16  # untouched
    assert not base.config.tie_word_embeddings  # a later tie_weights() must not put bf16 rows into the int8 layer
    kept = int8_sized_base()
    assert quantize_int8_weights(kept, Int8WeightsConfig(output_layer=False)) == 2 * 7
    assert type(kept.lm_head) is nn.Linear and kept.config.tie_word_embeddings
    with pytest.raises(BPDConfigError, match=r"load it with dtype=torch.bfloat16 \(CLI: --dtype bf16\)$"):
        quantize_int8_weights(int8_sized_base().float())


def test_compiled_int8_steps_use_int8_kernels_and_block_rows_equal_one_token_steps(int8_model):
    """The compiled step runs every int8 layer on an int8 kernel -- hf_bpd's packed one where the CPU has AVX512-BF16
    (`hf_bpd.runtime.kernels`), else inductor's weight-only int8 GEMM -- and a draft tree's rows equal, bit for bit,
    one-token compiled steps over the same path."""
    from torch._dynamo.utils import counters

    from hf_bpd.runtime.packed_linear import PackedLinear

    base = int8_model.base_lm
    runner = verify_runtime.compiled_runner(base, 64)
    assert runner.ordered
    before = counters["inductor"]["woq_matcher_count"]
    assert_tree_rows_equal_one_token_steps(int8_model, runner)
    if runner.packed is not None:
        assert sum(isinstance(m, PackedLinear) for m in runner.packed.modules()) == 15
    else:
        assert counters["inductor"]["woq_matcher_count"] - before >= 2 * 15  # two block lengths, 15 int8 layers each


@pytest.mark.parametrize("options", [{}, {"tree": (2, 2, 1)}, {"num_drafts": 3, "draft_top_k": 2},
                                     {"num_drafts": 3, "draft_top_k": 2, "draft_nodes": 3, "prompt_lookup": True},
                                     {"num_drafts": 3, "draft_top_k": 2, "draft_nodes": 3, "prompt_lookup": True,
                                      "draft_schedule": "cost"}],
                         ids=["chain", "tree", "pbest", "nodes", "nodes-cost"])
def test_compiled_int8_decoding_equals_compiled_plain_decoding(int8_model, options):
    assert_drafting_equals_plain(int8_model, options)


def test_from_pretrained_with_int8_weights_checks_the_fingerprint_first_and_drafts_in_bf16(tmp_path):
    """`quantization_config=Int8WeightsConfig()` quantizes after the fingerprint check (the heads were trained on the
    unquantized weights); the heads sit in bf16 and project through the dequantized output rows."""
    base = int8_sized_base(1)
    base.save_pretrained(tmp_path / "base")
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    model.save_pretrained(tmp_path / "heads")
    loaded = BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "heads", base_model=str(tmp_path / "base"),
                                                          dtype=torch.bfloat16, quantization_config=Int8WeightsConfig())
    assert has_int8_weights(loaded.base_lm)
    assert all(p.dtype == torch.bfloat16 for p in loaded.heads.parameters())
    projection = loaded.heads._base_projection_weight()
    assert projection.dtype == torch.bfloat16
    assert torch.equal(projection, loaded.base_lm.lm_head.dequantized_weight())
    ids = prompt_ids(1, 6)
    plain = loaded.generate(ids, use_heads=False, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(loaded.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None), plain)  # eager
    with pytest.raises(BPDConfigError, match="dtype=torch.bfloat16"):
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "heads", base_model=str(tmp_path / "base"),
                                                     quantization_config=Int8WeightsConfig())


def test_a_rescorer_derived_from_an_int8_base_reads_the_dequantized_weights():
    from hf_bpd.rescorers.neural import truncated_base

    base = int8_sized_base(2)
    quantize_int8_weights(base)
    small = truncated_base(base, 1)
    assert torch.equal(small.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.dequantized_weight())
    assert torch.equal(small.lm_head.weight, base.lm_head.dequantized_weight())


def test_real_smollm2_layers_in_int8_round_a_block_like_one_token_steps(smollm2):
    """SmolLM2's first 4 layers with int8 weights, compiled at 2 threads: each row of a block of 8 equals a one-token
    step bit for bit. Without `emulate_precision_casts` inductor kept an int8 layer's epilogue in fp32 for one block
    length and not the other, and 24 of these 24 rows differed."""
    from hf_bpd.rescorers.neural import truncated_base

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    base = truncated_base(smollm2[0], 4).to(torch.bfloat16)
    quantize_int8_weights(base)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=1).eval()
    runner = verify_runtime.compiled_runner(base, 512)
    tokens = torch.randint(100, 40000, (64,), generator=torch.Generator().manual_seed(0))
    prompt, path = tokens[None, :40], tokens[40:].tolist()
    try:
        with runner.lock, torch.no_grad():
            for start in range(0, 24, 8):
                context = torch.cat([prompt, tokens[None, 40:40 + start]], 1)
                verifier = CompiledVerifier(model, runner)
                verifier.buckets = [1, 8]
                verifier.prefill(context)
                block, _ = verifier.verify(path[start], DraftTree([tuple(path[start + 1:start + 8])]), "cpu")
                verifier.close(10 ** 9)
                verifier = CompiledVerifier(model, runner)
                verifier.prefill(context)
                for step, token in enumerate(path[start:start + 8]):
                    logits, _ = verifier.verify(token, DraftTree([]), "cpu")
                    assert torch.equal(logits[0], block[step]), (start, step)
                    verifier.keep(1, [0])
                verifier.close(10 ** 9)
    finally:
        torch.set_num_threads(threads)
        verify_runtime.discard_runners(base)
