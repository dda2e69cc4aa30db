"""Grouped-query attention over a masked block without copying the KV cache.

transformers' `sdpa` attention gives PyTorch's `scaled_dot_product_attention` the key/value heads repeated once per
query head (`repeat_kv`) whenever an attention mask is passed, and under `torch.compile` always. A verification step
always passes one (the draft tree's 4D mask over the cache), so each step would copy every layer's whole cache
`num_key_value_groups` times before reading it, a copy that grows with the cache and is a sizeable part of a compiled
step (docs/performance.md, "Why the compiled step is fast"). PyTorch's CPU kernel takes grouped heads as they are
(`enable_gqa=True`, masks included) and computes the same numbers: each query head reads its group's key/value head
where it read the copy, nothing else changes (bit-identical, `tests/test_attention.py`).

`grouped_query_attention(base)` makes the base use that while a verification step runs: it registers the attention
function under its own name with transformers' public `AttentionInterface` (and `sdpa`'s mask function with
`AttentionMaskInterface`) and sets the base's `config._attn_implementation` to it for the duration of the call.
Only bases on `sdpa` on a CPU are switched; every other case (no mask, no grouped heads, one eager query token,
dropout, soft-capping, position biases, other devices or attention implementations) runs transformers' `sdpa`
function unchanged. The name is switched with the config's own setter, not `set_attn_implementation`, because it
happens twice per step.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "hf_bpd_grouped_sdpa"


def _masked_cpu_attention(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether a call is plain masked attention on a CPU (no dropout, soft-capping, position biases or returned
    weights; keys and values of one head size): what hf_bpd's attention functions compute themselves."""
    return (attention_mask is not None and not dropout and query.device.type == "cpu"
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
            and not kwargs.get("output_attentions", False) and key.shape[-1] == value.shape[-1])


def grouped_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    """transformers' `sdpa` attention, with grouped key/value heads read in place when a mask is given on a CPU."""
    groups = getattr(module, "num_key_value_groups", 1)
    # One eager query token is left to transformers, which packs the grouped query heads instead (not bit-identical
    # to the repeated heads; eager plain decoding does that, so the eager verifier keeps doing it too).
    if (groups > 1 and (query.shape[2] > 1 or torch.compiler.is_compiling())
            and _masked_cpu_attention(query, key, value, attention_mask, dropout, kwargs)):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


AttentionInterface.register(ATTENTION_NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

BATCHED_ATTENTION_NAME = "hf_bpd_batched_attention"


def _two_gemm_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """Grouped-query attention as two GEMMs and a softmax, `(rows, heads, W, dim)` queries over `(rows, kv_heads,
    slots, dim)` keys/values read in place (query head h reads key/value head h // groups)."""
    rows, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scores = torch.matmul(query.reshape(rows, kv_heads, groups * width, dim), key.transpose(-1, -2)) * scale
    scores = scores.view(rows, kv_heads, groups, width, -1) + mask[:, :, None]
    probs = torch.softmax(scores, dim=-1).view(rows, kv_heads, groups * width, -1)
    return torch.matmul(probs, value).view(rows, heads, width, dim)


def stacked_query_attention(query, key, value, mask, scale: float | None) -> torch.Tensor:
    """Attention of one query token per row, `(rows, heads, 1, dim)` over `(rows, kv_heads, slots, dim)` keys/values
    read in place: each key/value head's query heads go to PyTorch's CPU kernel as that head's block of queries (an
    exact reshape; query head h reads key/value head h // groups either way), so the kernel multiplies a block where
    it ran one matrix-vector product per head. Returns `(rows, heads, 1, dim)`."""
    rows, heads, _, dim = query.shape
    stacked = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, 1, dim)


def _used_slots_attention(query, key, value, mask, cache_position, scale: float) -> torch.Tensor:
    """The batched step's attention over the cache slots in use, `[0, cache_position[-1]]` (the block is written
    at `cache_position`; every slot past it is masked for every row): one query token per row through PyTorch's
    CPU kernel (a key/value head's query heads stacked as its queries), several as `_two_gemm_attention`. Returns
    `(rows, W, heads, dim)`."""
    used = int(cache_position[-1]) + 1
    key, value, mask = key[:, :, :used], value[:, :, :used], mask[..., :used]
    if query.shape[2] == 1:  # each key/value head's query heads as one block of queries (a GEMM, not GEMVs)
        out = stacked_query_attention(query, key, value, mask, scale)
    else:
        out = _two_gemm_attention(query, key, value, mask, scale)
    return out.transpose(1, 2).contiguous()


def _used_slots_attention_shape(query, key, value, mask, cache_position, scale: float) -> torch.Tensor:
    rows, heads, width, dim = query.shape
    return query.new_empty(rows, width, heads, dim)


# An operator of its own, opaque to the compiler: how many slots are in use is read when the step runs (a compiled
# graph has one shape for the whole static cache), and the GEMMs read the cache in place (inductor's GEMM templates
# copied each layer's whole key cache into a transposed layout first).
_LIBRARY = torch.library.Library("hf_bpd", "FRAGMENT")
_LIBRARY.define("used_slots_attention(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor cache_position, "
                "float scale) -> Tensor")
_LIBRARY.impl("used_slots_attention", _used_slots_attention, "CPU")
torch.library.register_fake("hf_bpd::used_slots_attention", _used_slots_attention_shape, lib=_LIBRARY)


def batched_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                              is_causal=None, **kwargs):
    """Attention of a compiled batch step (one or a few query tokens in each of several rows, a mask over the whole
    static cache) over only the cache slots in use (`hf_bpd::used_slots_attention`), grouped key/value heads read in
    place; anything else as `grouped_sdpa_forward`.

    PyTorch's CPU flash kernel splits its work by (row, head, block of queries), which leaves a few query tokens per
    task, so several query tokens per row run as two GEMMs, which cost less than the kernel there; they run inside
    an operator opaque to the compiler, which reads the cache in place (inductor's GEMM templates would first copy
    each layer's key cache into their own layout). One token per row runs the kernel with each key/value head's
    query heads stacked as that head's queries (`stacked_query_attention`: the kernel then multiplies a block where
    it ran one matrix-vector product per query head), which makes the step a little faster."""
    rows, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    cache_position = kwargs.get("cache_position")
    if (cache_position is None or heads % kv_heads
            or not _masked_cpu_attention(query, key, value, attention_mask, dropout, kwargs)):
        return grouped_sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else dim ** -0.5
    return torch.ops.hf_bpd.used_slots_attention(query, key, value, attention_mask, cache_position, scale), None


AttentionInterface.register(BATCHED_ATTENTION_NAME, batched_attention_forward)
AttentionMaskInterface.register(BATCHED_ATTENTION_NAME, sdpa_mask)


def uses_grouped_attention(base) -> bool:
    """Whether `grouped_query_attention(base)` switches anything: a CPU base on transformers' `sdpa` attention."""
    return getattr(base.config, "_attn_implementation", None) == "sdpa" and base.device.type == "cpu"


@contextlib.contextmanager
def attention_implementation(base, name: str):
    """Run `base` on the registered attention implementation `name` inside the block; the one it had is restored on
    exit (the config's own attribute, not `set_attn_implementation`: this happens twice per step)."""
    config = base.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


@contextlib.contextmanager
def grouped_query_attention(base, enabled: bool = True, name: str = ATTENTION_NAME):
    """Run `base` on `grouped_sdpa_forward` inside the block (when `enabled`, which callers compute once with
    `uses_grouped_attention`), or on the attention registered as `name` (`BATCHED_ATTENTION_NAME`: a batched step's);
    its attention implementation is restored on exit."""
    if not enabled:
        yield
        return
    with attention_implementation(base, name):
        yield
