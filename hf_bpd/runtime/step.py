"""The unit every compiled verification runs: the base's decoder and output layer over a block on a static cache,
and which bases it can serve (`compile=True`'s `torch.compile`d steps and the ahead-of-time artifacts alike).

Bases with sliding-window layers (Gemma 2/3's hybrid layouts: `layer_types` mixing `"full_attention"` and
`"sliding_attention"`) run on the same cache: every layer keeps every position (`verification_cache`, no rolling
buffer), and the step derives the sliding layers' mask from the full one, closing the keys a query's window no longer
reaches (`query position - key position >= sliding_window`, transformers' own rule). Slot `i` of the cache holds
position `i` (rollback compacts the accepted path), so the rule is a comparison with the slot index. A rollback is then
the same key/value move for every layer type, and the window costs nothing until the context outgrows it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticCache, StaticLayer

from ..kv_cache import CACHE_NAME

WINDOWED_LAYER_TYPES = ("full_attention", "sliding_attention")  # the layer types a compiled step serves


def has_sliding_layers(config) -> bool:
    """Whether the decoder's `layer_types` name sliding-window layers."""
    return "sliding_attention" in (getattr(config.get_text_config(decoder=True), "layer_types", None) or ())


def kv_layout(config) -> tuple[int, int]:
    """`(key/value heads, head dim)` of the decoder's attention layers: one cache slot's shape per layer."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return heads, head_dim


def sliding_window_of(base) -> int | None:
    """The window of `base`'s sliding-window layers when its `layer_types` name any (None otherwise)."""
    if not has_sliding_layers(base.config):
        return None
    return getattr(base.config.get_text_config(decoder=True), "sliding_window", None)


def window_mask(attention_mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window layers' mask of one sequence's step from its full mask `(rows, 1, Q, L)`: slot `i` holds
    position `i`, and a key `window` or more positions behind a query is out of its reach (batches, whose slots hold
    other positions, build both masks themselves: `hf_bpd.generation.batch`)."""
    slots = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    too_old = slots[None, :] <= position_ids[0, :, None] - window
    return attention_mask.masked_fill(too_old, torch.finfo(attention_mask.dtype).min)


class VerificationCache(StaticCache):
    """A `StaticCache` whose every layer holds every position (`StaticLayer`s), sliding-window layers included: the
    step's masks bound the windows (see the module docstring)."""

    def __init__(self, config, max_cache_len: int):
        text_config = config.get_text_config(decoder=True)
        Cache.__init__(self, layers=[StaticLayer(max_cache_len=max_cache_len)
                                     for _ in range(text_config.num_hidden_layers)])


def verification_cache(config, max_cache_len: int) -> StaticCache:
    """The static cache a compiled step runs on: transformers' own `StaticCache` for full-attention bases, a
    `VerificationCache` for bases with sliding-window layers."""
    if has_sliding_layers(config):
        return VerificationCache(config, max_cache_len)
    return StaticCache(config=config, max_cache_len=max_cache_len)


def example_inputs(base, capacity: int = 64, block: int = 4, past: int = 8, rows: int = 2, slots: int | None = None):
    """`(cache, (ids, positions, mask, length, kv))`: example inputs of an exported step, `rows` rows of a `block`-token
    block written after `past` cached tokens into KV tensors of `capacity` slots; the mask spans `slots` key slots
    (default: the attended `past + block`), open to the cached tokens, causal in the block, closed after it."""
    heads, head_dim = kv_layout(base.config)
    cache = verification_cache(base.config, capacity)
    kv = [torch.zeros(rows, heads, capacity, head_dim, dtype=base.dtype) for _ in range(2 * len(cache.layers))]
    closed = torch.finfo(base.dtype).min
    mask = torch.full((rows, 1, block, slots or past + block), closed, dtype=base.dtype)
    mask[:, 0, :, :past] = 0
    mask[:, 0, :, past:past + block] = torch.triu(torch.full((block, block), closed, dtype=base.dtype), 1)
    ids = torch.zeros(rows, block, dtype=torch.long)
    return cache, (ids, (past + torch.arange(block)).repeat(rows, 1), mask, torch.tensor(past), kv)


def place_kv(cache: StaticCache, input_ids: torch.Tensor, length: torch.Tensor, kv) -> torch.Tensor:
    """Point `cache`'s layers at the tensors `kv` (keys, values, layer after layer), writing this block at `length`
    (an exported step's cache is its inputs); returns the block's cache positions."""
    for i, layer in enumerate(cache.layers):
        layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
        layer.device = layer.keys.device
        layer.cumulative_length = length.clone()  # this block's keys/values go to [length, length + Q)
        layer.is_initialized = True
    return length + torch.arange(input_ids.shape[1], device=input_ids.device)


class VerificationStep(nn.Module):
    """The base's decoder and output layer as one module (with the base's final logit soft-capping): the unit
    `torch.compile` freezes (`compiled`) and the artifacts export (`artifacts`)."""

    def __init__(self, base, cache: StaticCache):
        super().__init__()
        self.base = base
        self.cache = cache
        softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
        self.softcap = float(softcap) if softcap else None
        self.window = sliding_window_of(base)

    def forward(self, input_ids, position_ids, cache_position, attention_mask, key_slots=None, key_ranks=None):
        if self.window is not None and not isinstance(attention_mask, dict):  # (a batch passes its own masks)
            attention_mask = {"full_attention": attention_mask,
                              "sliding_attention": window_mask(attention_mask, position_ids, self.window)}
        extra = {} if key_slots is None else {"key_slots": key_slots, "key_ranks": key_ranks}  # ordered attention
        hidden = self.base.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                         cache_position=cache_position, attention_mask=attention_mask,
                                         **{CACHE_NAME: self.cache}, use_cache=True, **extra).last_hidden_state
        logits = self.base.get_output_embeddings()(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits, hidden


def compile_unsupported_reason(base) -> str | None:
    """Why a compiled step (in-process or an artifact) cannot serve `base` (None when it can)."""
    text_config = base.config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
    unserved = sorted(set(layer_types) - set(WINDOWED_LAYER_TYPES))
    if unserved:
        return f"its {', '.join(unserved)} layers have no compiled step"
    if "sliding_attention" in layer_types and not getattr(text_config, "sliding_window", None):
        return "its sliding-window layers name no window"
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True) \
            and getattr(text_config, "layer_types", None) is None and "mistral" in text_config.model_type:
        return "its sliding-window layers need a rolling cache"
    try:
        base.get_decoder(), base.get_output_embeddings()
    except Exception:  # noqa: BLE001
        return "it has no decoder / output layer to compile"
    if getattr(base, "hf_quantizer", None) is not None:
        return ("its quantized weights (transformers' quantizer) cannot be frozen: load it with dtype=torch.bfloat16, "
                "quantization_config=hf_bpd.Int8WeightsConfig() for int8 weights that compile")
    return None
