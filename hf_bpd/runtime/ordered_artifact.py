"""The artifact of a position-ordered bf16 base (int8 weights included) is code only (`hf_bpd.runtime.artifacts`).

Its step runs the base's packed module tree (`packed_linear.packed_base`: linear layers on hf_bpd's packed kernel,
attention on its ordered kernel), so the package holds no weights: the exported step's constants are every parameter
and buffer of that tree, given at load by the process as pointers to its own packed copy. A package is a few MB,
the process keeps one copy of the packed weights (the in-process compiled step's), and a base whose weights change
runs on the new ones. Which constants it takes (names, dtypes, shapes), not their bytes, is in its key; so a
background build's worker, which loads a saved copy of the base, rebuilds an int8-weight base's layout from a bf16
copy (`background._save_weights`).

The exported step takes each row's key order (`key_slots`, `key_ranks`: `hf_bpd.runtime.ordered_attention`) as
inputs, for one row, with a dynamic block length and cache capacity; the mask and the key order span the whole
cache, as the in-process step's do (the attention kernel reads only the slots some row can see).
"""

from __future__ import annotations

import hashlib

import torch

from .attention import attention_implementation
from .ordered_attention import ORDERED_KERNEL_ATTENTION, identity_key_order, uses_ordered_attention
from .step import VerificationStep, example_inputs, kv_layout, place_kv
from .unfrozen_artifact import own_constants


def supplies_constants(base) -> bool:
    """Whether `base`'s artifact is code only, its constants given by the process: position-ordered bf16 bases (int8
    weights included) whose linear layers and attention run on hf_bpd's kernels."""
    from .packed_linear import packing_unsupported_reason

    return (uses_ordered_attention(base) and kv_layout(base.config)[1] % 16 == 0  # the attention kernel's head dims
            and packing_unsupported_reason(base) is None)


def constants_layout(base) -> str:
    """A digest of the names, dtypes and shapes of `base`'s parameters and buffers: what a code-only artifact is
    built for."""
    tensors = [*base.named_parameters(remove_duplicate=False), *base.named_buffers(remove_duplicate=False)]
    layout = sorted(f"{name}:{t.dtype}:{tuple(t.shape)}" for name, t in tensors)
    return hashlib.sha256("\n".join(layout).encode()).hexdigest()[:16]


def supplied_constants(base) -> dict[str, torch.Tensor]:
    """The constants a code-only artifact runs on: every parameter and buffer of `base`'s packed module tree, by the
    names the exported step gives them."""
    from .packed_linear import packed_base

    return own_constants(packed_base(base))


class OrderedStep(VerificationStep):
    """The exported unit: `VerificationStep` on the packed module tree, the KV tensors and each row's key order as
    inputs, this block written at `length`."""

    def forward(self, input_ids, position_ids, attention_mask, length, key_slots, key_ranks, kv):
        positions = place_kv(self.cache, input_ids, length, kv)
        return super().forward(input_ids, position_ids, positions, attention_mask, key_slots, key_ranks)


def export_ordered(base, max_block: int, max_context: int):
    """`torch.export` of `OrderedStep` for `base`: one row, block lengths 1 to `max_block`, caches of up to
    `max_context` slots."""
    from .packed_linear import packed_base

    block, capacity = 4, 64
    cache, (ids, positions, mask, length, kv) = example_inputs(base, capacity, block, rows=1, slots=capacity)
    args = (ids, positions, mask, length, *identity_key_order(block, capacity, "cpu"), kv)
    block_dim = torch.export.Dim("block", min=1, max=max_block)
    capacity_dim = torch.export.Dim("capacity", min=32, max=max_context)
    order = {0: block_dim, 1: capacity_dim}
    shapes = {"input_ids": {1: block_dim}, "position_ids": {1: block_dim},
              "attention_mask": {2: block_dim, 3: capacity_dim}, "length": None, "key_slots": order,
              "key_ranks": order, "kv": [{2: capacity_dim}] * len(kv)}
    packed = packed_base(base)
    with torch.no_grad(), attention_implementation(packed, ORDERED_KERNEL_ATTENTION):
        return torch.export.export(OrderedStep(packed, cache).eval(), args, dynamic_shapes=shapes, strict=False)
