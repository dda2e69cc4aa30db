"""Grouped-query attention read in place (`hf_bpd.runtime.attention`): the verification step's attention without
the per-query-head copies of the KV cache, bit for bit what transformers' `sdpa` attention computes."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_bpd.runtime import attention
from tests.conftest import tiny_base


def _inputs(q, groups=2, kv_heads=2, slots=24, past=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, kv_heads * groups, q, 8, generator=g)
    key = torch.randn(1, kv_heads, slots, 8, generator=g)
    value = torch.randn(1, kv_heads, slots, 8, generator=g)
    mask = torch.zeros(1, 1, q, slots)
    mask[..., past + q:] = torch.finfo(torch.float32).min
    mask[0, 0, q - 1, past + 1] = torch.finfo(torch.float32).min  # a tree mask: one ancestor hidden
    return query, key, value, mask


@pytest.mark.parametrize("q", [1, 5, 8])
def test_grouped_attention_equals_transformers_sdpa_bit_for_bit(q):
    """With a mask and grouped heads: transformers repeats the keys/values per query head, this reads them in place;
    the numbers are the same. (Packing the grouped query heads into one head's rows instead, as transformers does
    for one eager query token, is not: it differs in the last bit, so one eager token is left to transformers.)"""
    module = tiny_base("llama").model.layers[0].self_attn
    assert module.num_key_value_groups == 2
    query, key, value, mask = _inputs(q)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    got, _ = attention.grouped_sdpa_forward(module, query, key, value, mask, scaling=module.scaling)
    assert got.shape == expected.shape == (1, q, 4, 8)
    assert torch.equal(got, expected)


def test_other_cases_run_transformers_sdpa_unchanged():
    module = tiny_base("llama").model.layers[0].self_attn
    query, key, value, mask = _inputs(4)
    # no mask: transformers' own GQA path (is_causal)
    expected, _ = sdpa_attention_forward(module, query, key, value, None, scaling=module.scaling, is_causal=True)
    got, _ = attention.grouped_sdpa_forward(module, query, key, value, None, scaling=module.scaling, is_causal=True)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="softcap"):  # what `sdpa` says about soft-capping, not a silent change
        attention.grouped_sdpa_forward(module, query, key, value, mask, softcap=30.0)


def test_the_switch_is_scoped_to_the_block_and_whole_forwards_agree():
    """Inside `grouped_query_attention` the base runs on the grouped function (a whole forward with a tree mask over
    a cache gives the same logits, bit for bit); outside, and after an error inside, it is on `sdpa` again."""
    base = tiny_base("llama")
    assert attention.uses_grouped_attention(base)
    ids = torch.tensor([[5, 9, 11, 3, 7, 21, 4]])
    mask = torch.zeros(1, 1, 7, 7)
    mask[0, 0] = torch.triu(torch.full((7, 7), torch.finfo(torch.float32).min), 1)
    mask[0, 0, 6, 5] = torch.finfo(torch.float32).min  # token 6 does not see token 5 (a sibling in a tree)
    with torch.no_grad():
        expected = base(ids, attention_mask=mask).logits
        with attention.grouped_query_attention(base):
            assert base.config._attn_implementation == attention.ATTENTION_NAME
            got = base(ids, attention_mask=mask).logits
    assert base.config._attn_implementation == "sdpa"
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="inside"), attention.grouped_query_attention(base):
        raise RuntimeError("inside")
    assert base.config._attn_implementation == "sdpa"


def test_only_sdpa_bases_are_switched():
    base = tiny_base("llama")
    base.set_attn_implementation("eager")
    assert not attention.uses_grouped_attention(base)
    with attention.grouped_query_attention(base, attention.uses_grouped_attention(base)):
        assert base.config._attn_implementation == "eager"


def test_one_token_under_compile_reads_the_grouped_heads_like_the_repeated_ones():
    """Traced by dynamo, one query token takes the grouped path too (transformers repeats the cache there); the
    numbers equal transformers' traced `sdpa`, bit for bit."""
    module = tiny_base("llama").model.layers[0].self_attn
    query, key, value, mask = _inputs(1)
    outs = []
    for fn in (sdpa_attention_forward, attention.grouped_sdpa_forward):
        torch._dynamo.reset()
        traced = torch.compile(lambda q, k, v, m, fn=fn: fn(module, q, k, v, m, scaling=module.scaling)[0],
                               backend="eager", fullgraph=True)
        outs.append(traced(query, key, value, mask))
    torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows, q", [(3, 1), (3, 2), (2, 5)])
def test_batched_attention_reads_the_used_slots_only(rows, q):
    """A batch step's attention (`batched_attention_forward`): over the slots up to the block (`cache_position`),
    as two GEMMs and a softmax for several query tokens per row, PyTorch's kernel for one (a key/value head's
    query heads stacked as its queries: a wrong head order fails here); the same numbers as
    PyTorch's kernel over every slot, up to rounding; whatever the slots past the block hold, nothing changes; and
    it traces into one graph (`hf_bpd::used_slots_attention`, opaque to the compiler)."""
    module = tiny_base("llama").model.layers[0].self_attn
    parts = [_inputs(q, seed=s) for s in range(rows)]
    query, key, value, mask = (torch.cat(t) for t in zip(*parts))
    where = torch.arange(10, 10 + q)  # `_inputs`: the block sits at slots 10 .. 10 + q - 1
    want, _ = attention.grouped_sdpa_forward(module, query, key, value, mask, scaling=module.scaling)
    got, _ = attention.batched_attention_forward(module, query, key, value, mask, scaling=module.scaling,
                                                 cache_position=where)
    assert got.shape == want.shape == (rows, q, 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # without the block's slots (not a batch step): PyTorch's kernel over every slot
    assert torch.equal(attention.batched_attention_forward(module, query, key, value, mask,
                                                           scaling=module.scaling)[0], want)
    key[:, :, 10 + q:], value[:, :, 10 + q:] = float("nan"), float("nan")  # unused slots are never read
    again, _ = attention.batched_attention_forward(module, query, key, value, mask, scaling=module.scaling,
                                                   cache_position=where)
    assert torch.equal(again, got)
    traced = torch.compile(lambda q_, k, v, m, c: attention.batched_attention_forward(
        module, q_, k, v, m, scaling=module.scaling, cache_position=c)[0], backend="aot_eager", fullgraph=True)
    assert torch.equal(traced(query, key, value, mask, where), got)
    torch._dynamo.reset()
