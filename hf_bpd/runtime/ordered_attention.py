"""Position-ordered attention: every row of a verification block attends exactly as a one-token step at its position.

In half precision (bf16, fp16) a greedy choice flips at the many near-ties whenever a block's row is rounded
differently from a one-token step at the same position; then drafting changes the output. Two things made them
differ:

* PyTorch's CPU `scaled_dot_product_attention` (the flash kernel) computes a query row differently depending on how
  many query rows the call has: with the same keys, values and mask, row 0 of a 2-row and of an 8-row call can
  differ, and once one layer differs every later layer follows. The linear layers, the norms and the rotary
  embedding are row-invariant, eagerly and compiled with inductor's CPU GEMM templates.
* A draft tree puts a node's ancestors in the block's slots, not at their positions (siblings sit between them), so
  the attention's sums over keys group the same terms differently from a one-token step, where slot `i` holds
  position `i`.

`ordered_attention_forward` fixes both. Each query row gets a map from its positions to cache slots (`key_slots`,
`(rows, cache length)`, a permutation per row, and its inverse `key_ranks`): position `i` of the row's own sequence is
slot `i` for the cached context and, inside the block, the slot of the row's ancestor at that depth. The scores are
one fp32 GEMM over the head dimension in slot order (a dot product per row and slot: no sum over slots), gathered into
each row's position order, masked by position and normalised there (the softmax's max and sum run over the row's
sequence exactly as a one-token step's do), scattered back to slot order, where a row's other block slots weigh 0,
and multiplied with the values in one more GEMM, which adds a row's terms in slot order, that is in position order
with exact zeros between. Compiled with inductor's CPU GEMM templates (`_Patches(ordered=True)` in
`hf_bpd.runtime.compiled`), every row of a block of 8 equals a one-token step at its position bit for bit, trees
included (`tests/test_ordered_attention.py`; run eagerly, MKL's GEMMs are not row-invariant). Plain decoding runs the
same compiled attention with the identity maps, so drafting on or off gives the same tokens.

Cost: compiled on a static cache, a one-token step runs faster than with PyTorch's kernel, and a block of 8 as
fast.

Used by the compiled steps of half-precision bases (`hf_bpd.runtime.compiled`); fp32 bases keep PyTorch's kernel and
the near-tie referee (`hf_bpd.generation.near_ties`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ORDERED_ATTENTION = "hf_bpd_ordered"
ORDERED_KERNEL_ATTENTION = "hf_bpd_ordered_kernel"  # the same order in C++ over the slots in use (bf16)
HALF_PRECISION = (torch.bfloat16, torch.float16)


def uses_ordered_attention(base) -> bool:
    """Whether `base`'s compiled steps attend in position order: half-precision CPU bases without attention
    soft-capping (Gemma 2's). Others keep PyTorch's kernel and are not exact in half precision (on GPUs the GEMMs are
    cuBLAS's, whose row invariance is not established here)."""
    text_config = base.config.get_text_config(decoder=True)
    return (base.dtype in HALF_PRECISION and base.device.type == "cpu"
            and not getattr(text_config, "attn_logit_softcapping", None))


def identity_key_order(rows: int, slots: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(key_slots, key_ranks)` of `rows` query rows that read every slot at its own position."""
    identity = torch.arange(slots, device=device).expand(rows, -1).contiguous()
    return identity, identity.clone()


def block_key_order(parents: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(key_slots, key_ranks)` inside a block of `rows` slots (the root, then draft-tree nodes with `parents`, -1 for
    the root's children, parents first; then padding): row `i` reads, at depth `j`, the block slot of its ancestor at
    depth `j`, then its other block slots in slot order (closed by the mask); padding rows read the block in order."""
    slots = torch.arange(rows).repeat(rows, 1)
    for node in range(len(parents)):
        path, ancestor = [], node
        while ancestor >= 0:
            path.insert(0, ancestor + 1)
            ancestor = parents[ancestor]
        path.insert(0, 0)
        slots[node + 1] = torch.tensor(path + sorted(set(range(rows)) - set(path)))
    return slots, torch.argsort(slots, dim=-1)


def placed_key_order(order: tuple[torch.Tensor, torch.Tensor], past: int, slots: int, device):
    """The whole cache's `(key_slots, key_ranks)` for a block's `order` (`block_key_order`) written after `past`."""
    key_slots, key_ranks = identity_key_order(len(order[0]), slots, device)
    key_slots[:, past:past + len(order[0])] = past + order[0]
    key_ranks[:, past:past + len(order[0])] = past + order[1]
    return key_slots, key_ranks


def ordered_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                              key_slots=None, key_ranks=None, **kwargs):
    """Attention over each row's own sequence in position order (see the module docstring).

    `query (batch, heads, rows, dim)`; `key`/`value (batch, kv_heads, slots, dim)`, the whole static cache;
    `attention_mask (batch, 1, rows, slots)` additive, by position; `key_slots (rows, slots)` the slot each position
    of each row reads, a permutation per row, and `key_ranks` its inverse (the position each slot holds); None: slot =
    position for every row."""
    if dropout or kwargs.get("softcap") is not None:
        raise NotImplementedError("ordered attention serves no dropout or attention soft-capping")
    batch, heads, rows, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.float().reshape(batch, kv_heads, groups * rows, dim)
    # one dot product per (row, slot), in slot order (a GEMM over the head dimension)
    scores = torch.matmul(q, key.float().transpose(-1, -2)).reshape(batch, kv_heads, groups, rows, slots) * scale
    if key_slots is not None:  # each row's scores in its own position order
        scores = scores.gather(-1, key_slots.expand(batch, kv_heads, groups, rows, slots))
    if attention_mask is not None:
        scores = scores + attention_mask.float().reshape(batch, 1, 1, rows, slots)
    weights = torch.softmax(scores, dim=-1)  # the max and the sum run over positions
    if key_ranks is not None:  # back to slot order: a row's ancestors keep their order, the other slots weigh 0
        weights = weights.gather(-1, key_ranks.expand(batch, kv_heads, groups, rows, slots))
    out = torch.matmul(weights.reshape(batch, kv_heads, groups * rows, slots), value.float())
    out = out.to(query.dtype).reshape(batch, heads, rows, dim)
    return out.transpose(1, 2).contiguous(), None


def ordered_kernel_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                                     key_slots=None, key_ranks=None, **kwargs):
    """`ordered_attention_forward`'s contract on `torch.ops.hf_bpd_kernels.ordered_attention`
    (`csrc/ordered_attention.cpp`, loaded by `hf_bpd.runtime.kernels`): each row over its positions in order, the
    values summed in position order, reading only the slots some row can see. Selected by the compiled steps of bf16
    bases where the kernels load; its sums are grouped differently from the PyTorch version's, so a base's plain and
    drafted steps use the same one."""
    if dropout or kwargs.get("softcap") is not None:
        raise NotImplementedError("ordered attention serves no dropout or attention soft-capping")
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.hf_bpd_kernels.ordered_attention(query, key, value, attention_mask, key_slots, scale), None


AttentionInterface.register(ORDERED_ATTENTION, ordered_attention_forward)
AttentionMaskInterface.register(ORDERED_ATTENTION, sdpa_mask)
AttentionInterface.register(ORDERED_KERNEL_ATTENTION, ordered_kernel_attention_forward)
AttentionMaskInterface.register(ORDERED_KERNEL_ATTENTION, sdpa_mask)
