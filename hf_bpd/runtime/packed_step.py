"""A batched verification step over each row's own tokens: the rows' blocks packed into one sequence.

A batched step on the artifact (`hf_bpd.runtime.batched`) verifies a `(rows, W)` block: every row computes `W` tokens,
the widest row's, and a step's cost follows its tokens (SmolLM2 fp32, AMD EPYC, 2 threads, 300 cached tokens: 1 row x
8 tokens 29.8 ms, 4 x 2 27.7, 4 x 1 20–22), so one row's drafts make every row pay for them. Here row `r` computes its
own `n_r` tokens only: the tokens of all rows go through the decoder as one `(1, T)` sequence (`T = sum n_r`), so the
GEMMs see `T` rows; each layer's cache (`PackedBlockCache`) writes token `t`'s keys and values to its row's cache row at
its own slot, and the attention (`packed_attention`) scatters the packed queries to the `(rows, widest block)`
layout, attends over each row's own cache with the step's `(rows, 1, widest block, attended)` mask (as a rectangular
step does) and gathers the outputs back into the packed order. Attention is the step's small part; the padding it
keeps costs little.

Measured on AOTInductor builds of this step (rows, packed tokens and widest block dynamic; the artifact's options;
SmolLM2 fp32, AMD EPYC, 2 threads, 300 cached tokens), beside the rectangular artifact step in the same process, over
four runs of two builds: 4 rows with 2,1,1,1 tokens 22.0–31.7 ms against 29.4–32.9 for 4 x 2, with 1 each
20.5–26.4 against 22.8–27.1 for 4 x 1; 16 rows with 2 tokens on 8 of them 72.6–94.0 against 84.9–96.6 for 16 x 2.
Logits within 8e-5 of each row decoded alone, the same greedy tokens (floating-point sums as in a padded batch).
The runs disagree by up to a third on one shape (this VM's speed, and the GEMM kernels AOTInductor tunes at the
example's shape). Tried in batched decoding with a width per row, it lost to the uniform width choice (SmolLM2, AMD
EPYC, 2 threads: 0.84x at 4 rows; docs/performance.md#batches): a step's cost grows in steps set by the GEMMs' row
blocks, and the uniform widths already land on the cheap shapes. Full-attention bases only (no sliding windows, no
logit soft-capping); not used by batched decoding.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..kv_cache import CACHE_NAME
from .artifacts import _example, attended_sdpa_forward
from .attention import attention_implementation
from .step import has_sliding_layers

ATTENTION_NAME = "hf_bpd_packed_sdpa"


class _PackedLayer(CacheLayerMixin):
    """One layer's keys and values, `(rows, kv heads, capacity, head dim)`, written token by token at `(row, slot)`."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.rows, self.slots = keys, values, rows, slots
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the tensors are the caller's
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the packed `(1, kv heads, T, head dim)` keys and values at their rows' slots; return the cache."""
        self.keys[self.rows, :, self.slots] = key_states[0].transpose(0, 1).to(self.keys.dtype)
        self.values[self.rows, :, self.slots] = value_states[0].transpose(0, 1).to(self.values.dtype)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return int(self.slots.min()) if self.slots.numel() else 0

    def get_max_cache_shape(self) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class PackedBlockCache(Cache):
    """The batch's static cache (`kv`: keys and values of each layer in turn) seen by a packed step: token `t` of the
    packed block belongs to row `rows[t]` and is written at slot `slots[t]`."""

    def __init__(self, kv: list[torch.Tensor], rows: torch.Tensor, slots: torch.Tensor):
        Cache.__init__(self, layers=[_PackedLayer(kv[i], kv[i + 1], rows, slots) for i in range(0, len(kv), 2)])


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                     packed_index=None, **kwargs):
    """Attention of the packed queries `(1, heads, T, head dim)`: placed at `packed_index` (`row * widest + column`) of
    the `(rows, widest block)` layout the mask `(rows, 1, widest, attended)` covers, attended over each row's first
    `attended` cache slots, gathered back; returns `(1, T, heads, head dim)` as transformers' attention functions do."""
    rows, width = attention_mask.shape[0], attention_mask.shape[2]
    heads, head_dim = query.shape[1], query.shape[-1]
    placed = query.new_zeros(rows * width, heads, head_dim)
    placed[packed_index] = query[0].transpose(0, 1)
    placed = placed.view(rows, width, heads, head_dim).transpose(1, 2)
    out, _ = attended_sdpa_forward(module, placed, key, value, attention_mask, scaling=scaling)  # (rows, width, ...)
    return out.reshape(rows * width, heads, head_dim)[packed_index][None].contiguous(), None


AttentionInterface.register(ATTENTION_NAME, packed_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def unsupported_reason(base) -> str | None:
    """Why a packed step cannot serve `base` (None when it can)."""
    if has_sliding_layers(base.config):
        return "sliding-window layers have no packed step"
    if getattr(base.config.get_text_config(), "final_logit_softcapping", None):
        return "logit soft-capping has no packed step"
    return None


def packed_layout(counts: list[int], length: int) -> dict[str, torch.Tensor]:
    """The index tensors of a packed block whose row `r` verifies `counts[r]` tokens written from slot `length` on:
    `rows`, `slots` and `packed_index` (`row * widest + column`) of each packed token, rows in order."""
    width = max(counts)
    rows = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(counts)])
    columns = torch.cat([torch.arange(n) for n in counts])
    return {"rows": rows, "slots": length + columns, "packed_index": rows * width + columns}


class PackedStep(torch.nn.Module):
    """The base's decoder and output layer over a packed block: `input_ids` and `position_ids` `(1, T)`, the
    `(rows, 1, widest, attended)` mask of the rectangular layout, each token's `rows`, `slots` and `packed_index`
    (`packed_layout`), and the cache's keys and values `kv` (written in place). Returns `(logits, hidden)`, `(1, T, .)`.
    Run it inside `attention_implementation(base, ATTENTION_NAME)`."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, input_ids, position_ids, attention_mask, rows, slots, packed_index, kv):
        cache = PackedBlockCache(kv, rows, slots)
        hidden = self.base.get_decoder()(input_ids=input_ids, position_ids=position_ids, cache_position=slots,
                                         attention_mask=attention_mask, **{CACHE_NAME: cache}, use_cache=True,
                                         packed_index=packed_index).last_hidden_state
        return self.base.get_output_embeddings()(hidden), hidden


def export_packed_step(base, max_rows: int = 64, max_tokens: int = 256, max_width: int = 16,
                       max_context: int = 32768):
    """`torch.export` of `PackedStep` with the rows, the packed tokens, the widest block, the cache's capacity and the
    attended length dynamic. The example (4 rows verifying 3, 1, 5 and 1 tokens after 8 cached ones, a 64-slot cache)
    is the shape AOTInductor tunes each GEMM's kernel for."""
    counts, past = [3, 1, 5, 1], 8
    _, (_, _, mask, _, kv) = _example(base, capacity=64, block=max(counts), past=past, rows=len(counts))
    layout = packed_layout(counts, past)
    ids = torch.zeros(1, sum(counts), dtype=torch.long)
    args = (ids, layout["slots"][None].clone(), mask, layout["rows"], layout["slots"], layout["packed_index"], kv)
    rows, tokens = torch.export.Dim("rows", max=max_rows), torch.export.Dim("tokens", max=max_tokens)
    shapes = {"input_ids": {1: tokens}, "position_ids": {1: tokens},
              "attention_mask": {0: rows, 2: torch.export.Dim("width", max=max_width),
                                 3: torch.export.Dim("attended", min=2, max=max_context)},
              "rows": {0: tokens}, "slots": {0: tokens}, "packed_index": {0: tokens},
              "kv": [{0: rows, 2: torch.export.Dim("capacity", min=16, max=max_context)}] * len(kv)}
    with torch.no_grad(), attention_implementation(base, ATTENTION_NAME):
        return torch.export.export(PackedStep(base).eval(), args, dynamic_shapes=shapes, strict=False)
