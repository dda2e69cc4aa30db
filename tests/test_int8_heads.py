"""The int8 heads step (`hf_bpd.runtime.int8_heads`): the C++ kernel against PyTorch on the dequantised weights,
decoding with it stays exact, and what it cannot serve falls back with a one-line warning."""

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from hf_bpd import BlockwiseParallelForCausalLM, BPDTypeError
from hf_bpd.runtime import compiled as verify_runtime
from hf_bpd.runtime.int8_heads import (Int8HeadsStep, load_kernel, quantize_input, quantize_rows, quantizes_inputs,
                                      unsupported_reason)
from tests.conftest import VOCAB, tiny_base
from tests.test_decoding import prompt_ids, random_bpd


def random_heads_model(head_type: str, layers: int = 1, arch: str = "llama", draft_vocab=None, seed: int = 0,
                       hidden: int = 40):
    """A tiny base (hidden size 40: not a multiple of the kernel's 8 or 16 lanes) with random heads."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0)
    else:  # final_logit_softcapping
        config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, final_logit_softcapping=3.0)
    base = AutoModelForCausalLM.from_config(config).eval()
    fields = dict(num_heads=3, head_type=head_type, num_layers_per_head=layers)
    if head_type == "ffn":
        fields["head_intermediate_size"] = 52
    if draft_vocab is not None:
        fields["draft_vocab"] = draft_vocab
    model = BlockwiseParallelForCausalLM.from_base(base, **fields)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.heads.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.eval()


def dequantized(heads):
    """A copy of `heads` whose weights are exactly what the kernel multiplies with (int8 x row scale)."""
    copied = copy.deepcopy(heads)
    with torch.no_grad():
        for module in copied.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_rows(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
        q, scale = quantize_rows(heads._base_projection_weight())
    copied._base_projection_weight = lambda: q.float() * scale[:, None]
    return copied


def test_quantize_rows_bounds_the_error_and_keeps_zero_rows():
    weight = torch.randn(37, 29) * torch.logspace(-3, 1, 37)[:, None]
    weight[5] = 0
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.all((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.all(q[5] == 0)
    assert torch.equal(q.abs().amax(1)[weight.abs().amax(1) > 0], torch.full((36,), 127, dtype=torch.int8))


@pytest.mark.parametrize("head_type, layers, arch, vocab", [
    ("ffn", 1, "llama", None), ("ffn", 2, "llama", list(range(3, 83))), ("resblock", 1, "llama", None),
    ("resblock", 2, "gemma3", list(range(10, 90))), ("ffn", 1, "gemma3", None)])
def test_kernel_equals_pytorch_on_the_dequantized_weights(head_type, layers, arch, vocab):
    """Every head type, block count, draft vocabulary and soft-capping: the kernel's top-k log-probabilities and
    indices are PyTorch's on the same (dequantised) weights."""
    assert load_kernel() is not None
    model = random_heads_model(head_type, layers, arch, vocab)
    step = Int8HeadsStep(model.heads, 16)
    reference = verify_runtime._HeadsStep(dequantized(model.heads), 16).eval()
    if quantizes_inputs():  # AVX512-VNNI: every layer's input vectors are rounded to int16 steps first
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (quantize_input(args[0]),))
        project = reference.project
        reference.project = lambda states, index=None: project(quantize_input(states), index)
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        hidden = torch.randn(model.config.hidden_size, generator=generator)
        values, indices = step(hidden)
        with torch.no_grad():
            want_values, want_indices = reference(hidden, torch.tensor(0))
        assert values.shape == (3, 16) and indices.dtype == torch.long
        torch.testing.assert_close(values, want_values, rtol=1e-4, atol=1e-4)
        # equal up to near-ties: where the orders differ, the values are equal within rounding
        differ = indices != want_indices
        assert torch.all((values - want_values).abs()[differ] < 1e-4)
        assert torch.equal(indices[:, 0], want_indices[:, 0])


@pytest.mark.parametrize("head_type, layers, arch", [("ffn", 2, "llama"), ("resblock", 1, "gemma3")])
def test_the_rows_call_equals_one_call_per_row(head_type, layers, arch):
    """A batch's heads step (`Int8HeadsStep.rows`: every row in one call, each weight read once for several rows)
    gives each row bit for bit what a call on its own hidden state gives, whatever the number of rows."""
    model = random_heads_model(head_type, layers, arch)
    step = Int8HeadsStep(model.heads, 5)
    generator = torch.Generator().manual_seed(4)
    for n in (1, 3, 6, 4, 0):  # the buffers grow, and are reused by fewer rows
        hidden = torch.randn(n, model.config.hidden_size, generator=generator)
        values, indices = step.rows(hidden)
        assert values.shape == indices.shape == (n, 3, 5)
        for r in range(n):
            one_values, one_indices = step(hidden[r])
            assert torch.equal(values[r], one_values) and torch.equal(indices[r], one_indices)
    with pytest.raises(ValueError, match="hidden states"):
        step.rows(torch.zeros(2, model.config.hidden_size + 1))


@pytest.mark.parametrize("head_type, layers, arch", [("ffn", 2, "llama"), ("resblock", 1, "gemma3")])
def test_the_rows_call_of_the_first_heads_equals_theirs_in_the_full_call(head_type, layers, arch):
    """A batched step that verifies fewer depths runs only their heads (`rows(hidden, heads)`): bit for bit the
    first heads of the call that runs them all."""
    model = random_heads_model(head_type, layers, arch)
    step = Int8HeadsStep(model.heads, 5)
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    values, indices = step.rows(hidden)
    for heads in (1, 2, 3, 1):  # the buffers shrink and grow
        first_values, first_indices = step.rows(hidden, heads)
        assert first_values.shape == (4, heads, 5)
        assert torch.equal(first_values, values[:, :heads]) and torch.equal(first_indices, indices[:, :heads])
    for heads in (0, 4):
        with pytest.raises(ValueError, match="1 to 3 heads"):
            step.rows(hidden, heads)


def test_int8_drafts_stay_close_to_the_fp32_heads():
    """Quantisation moves each weight by at most half a step: the heads' best token mostly stays the same."""
    model = random_heads_model("ffn", 1, "llama", None, hidden=64)
    step = Int8HeadsStep(model.heads, 16)
    reference = verify_runtime._HeadsStep(model.heads, 16).eval()
    generator = torch.Generator().manual_seed(5)
    same = 0
    for _ in range(50):
        hidden = torch.randn(model.config.hidden_size, generator=generator)
        with torch.no_grad():
            same += int((step(hidden)[1][:, 0] == reference(hidden, torch.tensor(0))[1][:, 0]).sum())
    assert same >= 0.9 * 150


def test_bf16_heads_are_quantised_from_their_own_values():
    """A bf16 model's heads (and output layer) are served too: the step is the one quantised from the same weights
    held in fp32 (bf16 converts to fp32 exactly), and it reads the bf16 hidden state as fp32."""
    model = random_heads_model("resblock", 1, "llama", None, hidden=64)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert unsupported_reason(bf16.heads) is None
    step = Int8HeadsStep(bf16.heads, 16)
    widened = Int8HeadsStep(copy.deepcopy(bf16).float().heads, 16)
    generator = torch.Generator().manual_seed(6)
    for _ in range(10):
        hidden = torch.randn(model.config.hidden_size, generator=generator).to(torch.bfloat16)
        values, indices = step(hidden)
        want_values, want_indices = widened(hidden.float())
        assert torch.equal(values, want_values) and torch.equal(indices, want_indices)


def test_heads_over_an_int8_output_layer_are_served():
    """An int8-weight base (`Int8WeightLinear` output layer): the step quantises the layer's dequantised rows, which
    gives back its own int8 rows, so it equals the step over those rows held in bf16."""
    from hf_bpd.runtime.int8_weights import Int8WeightLinear

    model = copy.deepcopy(random_heads_model("ffn", 1, "llama", None, hidden=64)).to(torch.bfloat16)
    rows = copy.deepcopy(model)
    layer = Int8WeightLinear.from_linear(model.base_lm.lm_head)
    model.base_lm.lm_head = layer
    model.heads._output_embeddings[0] = layer
    with torch.no_grad():
        rows.base_lm.lm_head.weight.copy_(layer.dequantized_weight())
    assert unsupported_reason(model.heads) is None
    step, want = Int8HeadsStep(model.heads, 8), Int8HeadsStep(rows.heads, 8)
    generator = torch.Generator().manual_seed(7)
    for _ in range(10):
        hidden = torch.randn(model.config.hidden_size, generator=generator).to(torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(step(hidden), want(hidden)))


@pytest.mark.parametrize("options", [{}, {"num_drafts": 3, "draft_top_k": 2}, {"tree": (2, 2, 1)},
                                     {"prompt_lookup": True}])
def test_eager_decoding_with_int8_heads_is_exact(options):
    model = random_bpd("llama", 2)
    for seed in range(3):
        ids = prompt_ids(60 + seed, 3 + 4 * seed)
        kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # served: no fallback warning
            got = model.generate(ids, heads_int8=True, **options, **kwargs)
        assert torch.equal(got, model.base_lm.generate(ids, **kwargs)), (seed, options)
        assert model.last_generation_stats.block_efficiency >= 1.0


def test_heads_the_kernel_cannot_serve_fall_back_with_a_warning():
    model = random_bpd("llama", 2)
    hydra = BlockwiseParallelForCausalLM.from_base(model.base_lm, num_heads=2, head_type="hydra",
                                                   head_intermediate_size=24).eval()
    assert "sequential" in unsupported_reason(hydra.heads)
    ids = prompt_ids(7, 6)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    with pytest.warns(UserWarning, match="heads_int8 is not used .*sequential"):
        got = hydra.generate(ids, heads_int8=True, **kwargs)
    assert torch.equal(got, model.base_lm.generate(ids, **kwargs))
    assert "neither float32 nor bfloat16" in unsupported_reason(copy.deepcopy(model).to(torch.float16).heads)


def test_heads_int8_must_be_a_bool():
    model = random_bpd("llama", 2)
    with pytest.raises(BPDTypeError, match="heads_int8 must be True, False or None"):
        model.generate(prompt_ids(1, 4), max_new_tokens=3, heads_int8="yes")


def test_a_kernel_that_does_not_build_falls_back(tmp_path):
    """No C++ compiler: generation warns once and drafts with the heads' own weights, output unchanged."""
    child = """
import json, warnings, torch
from tests.test_decoding import random_bpd, prompt_ids
model = random_bpd("llama", 2)
ids = prompt_ids(2, 5)
kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = model.generate(ids, heads_int8=True, **kwargs)
print("RESULT", json.dumps({"same": torch.equal(got, model.base_lm.generate(ids, **kwargs)),
                            "warnings": [str(w.message) for w in caught if "heads_int8" in str(w.message)]}))
"""
    env = {**os.environ, "CXX": "/bin/false", "HF_BPD_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", child], cwd=os.path.dirname(os.path.dirname(__file__)), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["same"]
    assert len(result["warnings"]) == 1 and "did not build" in result["warnings"][0], result["warnings"]


def test_the_step_is_quantised_once_and_again_when_the_weights_change():
    from hf_bpd.runtime.int8_heads import cached_step

    model = random_heads_model("ffn")
    step = cached_step(model.heads, 16)
    wide = cached_step(model.heads, 64 if model.heads.config.draft_size >= 64 else 8)
    assert cached_step(model.heads, 16) is step and wide is not step  # each lattice width kept
    hidden = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model.heads.heads[0].blocks[0].up.weight.mul_(-2.0)
    again = cached_step(model.heads, 16)
    assert again is not step
    with torch.no_grad():
        want = verify_runtime._HeadsStep(dequantized(model.heads), 16).eval()(hidden, torch.tensor(0))
    torch.testing.assert_close(again(hidden)[0], want[0], rtol=1e-4, atol=1e-4)
