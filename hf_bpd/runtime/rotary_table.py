"""Rotary embeddings read from a table in the compiled steps of bf16 and int8-weight bases.

A decoder computes its rotary `cos` and `sin` once per forward, but inductor fuses that pointwise computation into
every layer's consumer and so evaluates `cos` and `sin` again in each layer, for each query and key head, work that
adds up over the layers for nothing. `RotaryTable` computes both once for every position with the model's own module
(eagerly, in fp32) and returns rows of that table: in the compiled step a gather, which is what inductor then fuses
instead.

Only the plainest rotary modules are replaced: `forward(x, position_ids)` returning `(cos, sin)` in `x`'s dtype,
with a rope type whose frequencies do not depend on the sequence (`"default"`, `"linear"`, `"llama3"`), and a table
of at most `MAX_TABLE_BYTES`. Everything else keeps its module.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

MAX_TABLE_BYTES = 32 * 2**20  # cos and sin, fp32
_STATIC_ROPE_TYPES = ("default", "linear", "llama3")


class RotaryTable(nn.Module):
    """`(x, position_ids) -> (cos, sin)` in `x`'s dtype, rows of tables computed once by `rotary` (fp32)."""

    def __init__(self, rotary: nn.Module, positions: int):
        super().__init__()
        with torch.no_grad():
            ids = torch.arange(positions, device=rotary.inv_freq.device)[None]
            probe = torch.zeros((), dtype=torch.float32, device=rotary.inv_freq.device)
            cos, sin = rotary(probe, ids)
        self.register_buffer("cos_table", cos[0].contiguous(), persistent=False)
        self.register_buffer("sin_table", sin[0].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_table[position_ids].to(x.dtype), self.sin_table[position_ids].to(x.dtype)


def tabled(rotary: nn.Module, positions: int) -> RotaryTable | None:
    """`rotary` as a `RotaryTable` over `positions` positions, or None when it is not one this serves (see the module
    docstring)."""
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or getattr(rotary, "rope_type", None) not in _STATIC_ROPE_TYPES:
        return None
    try:
        parameters = list(inspect.signature(rotary.forward).parameters)
    except (TypeError, ValueError):
        return None
    if parameters != ["x", "position_ids"] or positions <= 0:
        return None
    if 2 * positions * 2 * inv_freq.numel() * 4 > MAX_TABLE_BYTES:
        return None
    return RotaryTable(rotary, positions)


def table_rotary_embeddings(model: nn.Module, positions: int) -> int:
    """Replace, in place, every rotary module of `model` that `tabled` serves; returns how many."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not name or not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        table = tabled(module, positions)
        if table is not None:
            model.set_submodule(name, table)
            replaced += 1
    return replaced
