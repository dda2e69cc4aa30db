"""The packed batched step (`hf_bpd.runtime.packed_step`): each row verifies only its own tokens, packed with the
other rows' into one sequence, and gets what it gets alone."""

import torch
from transformers.cache_utils import DynamicCache

from hf_bpd.runtime.attention import attention_implementation
from hf_bpd.runtime.packed_step import (ATTENTION_NAME, PackedStep, export_packed_step, packed_layout,
                                        unsupported_reason)
from hf_bpd.runtime.step import kv_layout
from tests.conftest import VOCAB, tiny_base


def _batch(base, prompt_lengths, capacity):
    """Each prompt's lone prompt pass (its own `DynamicCache`), and the batch's static cache holding row `r`'s keys
    and values at slots `[0, len_r)`; the slots after a row's prompt stay empty (holes the mask closes)."""
    torch.manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,)) for n in prompt_lengths]
    heads, head_dim = kv_layout(base.config)
    kv = [torch.zeros(len(prompts), heads, capacity, head_dim) for _ in range(2 * base.config.num_hidden_layers)]
    alone = []
    with torch.no_grad():
        for r, prompt in enumerate(prompts):
            cache = DynamicCache()
            base(input_ids=prompt[None], past_key_values=cache, use_cache=True)
            alone.append(cache)
            for i, layer in enumerate(cache.layers):
                kv[2 * i][r, :, : len(prompt)], kv[2 * i + 1][r, :, : len(prompt)] = layer.keys[0], layer.values[0]
    return prompts, kv, alone


def _packed_inputs(prompts, counts, length, kv):
    closed = torch.finfo(torch.float32).min
    width = max(counts)
    torch.manual_seed(2)
    blocks = [torch.randint(3, VOCAB, (n,)) for n in counts]
    mask = torch.full((len(prompts), 1, width, length + width), closed)
    for r, prompt in enumerate(prompts):
        mask[r, 0, :, : len(prompt)] = 0  # its prompt; the slots up to `length` are holes
        mask[r, 0, :, length:] = torch.triu(torch.full((width, width), closed), 1)  # its own block, causal
    layout = packed_layout(counts, length)
    positions = torch.cat([len(p) + torch.arange(n) for p, n in zip(prompts, counts)])[None]
    return blocks, (torch.cat(blocks)[None], positions, mask, layout["rows"], layout["slots"],
                    layout["packed_index"], kv)


def test_each_row_of_a_packed_step_gets_its_lone_logits_and_writes_only_its_own_slots():
    base = tiny_base("llama")
    prompts, kv, alone = _batch(base, [7, 4, 10], capacity=24)
    length, counts = 10, [3, 1, 4]
    blocks, args = _packed_inputs(prompts, counts, length, kv)
    before = [t.clone() for t in kv]
    with torch.no_grad(), attention_implementation(base, ATTENTION_NAME):
        logits, hidden = PackedStep(base)(*args)
    assert logits.shape == (1, sum(counts), VOCAB) and hidden.shape[:2] == (1, sum(counts))
    start = 0
    with torch.no_grad():
        for r, (block, n) in enumerate(zip(blocks, counts)):
            expected = base(input_ids=block[None], past_key_values=alone[r], use_cache=True).logits[0]
            torch.testing.assert_close(logits[0, start: start + n], expected, atol=1e-5, rtol=1e-5)
            start += n
            for i, layer in enumerate(alone[r].layers):  # its block's keys/values at [length, length + n)
                torch.testing.assert_close(kv[2 * i][r, :, length: length + n], layer.keys[0, :, -n:])
                torch.testing.assert_close(kv[2 * i + 1][r, :, length: length + n], layer.values[0, :, -n:])
                untouched = torch.ones(kv[2 * i].shape[2], dtype=torch.bool)
                untouched[length: length + n] = False
                assert torch.equal(kv[2 * i][r][:, untouched], before[2 * i][r][:, untouched])


def test_the_packed_step_exports_with_rows_tokens_and_width_dynamic():
    base = tiny_base("llama")
    exported = export_packed_step(base)  # exported from 4 rows verifying 3, 1, 5 and 1 tokens
    prompts, kv, _ = _batch(base, [6, 3, 9], capacity=20)  # other rows, tokens, width and capacity
    _, args = _packed_inputs(prompts, [1, 4, 2], 9, kv)  # 3 rows, 7 tokens, widest 4
    with torch.no_grad(), attention_implementation(base, ATTENTION_NAME):
        expected = PackedStep(base)(*args)[0]
        got = exported.module()(*args)[0]  # writes the same keys/values to the same slots again
    torch.testing.assert_close(got, expected)


def test_bases_the_packed_step_cannot_serve_say_why():
    assert unsupported_reason(tiny_base("llama")) is None
    assert "sliding" in unsupported_reason(tiny_base("gemma3"))
