"""Block drafting (paper Alg. 1, stage 1): heads -> top-k lattice -> rescorer -> draft(s)."""

from __future__ import annotations

import torch

from ..lattice import Lattice
from ..rescorers.base import HeadScoreRescorer, Rescorer


class BlockDrafter:
    """Drafts from one base hidden state with the first `num_heads` heads.

    Args:
        heads: the model's `DraftHeads`.
        num_heads: heads to use (block size = num_heads + 1).
        top_k: lattice width (candidates per head).
        num_drafts: drafts returned per step (p-best); 1 for chain decoding.
        rescorer: picks drafts from the lattice; `HeadScoreRescorer` (head scores only) by default.
        tree_choices: Medusa-style rank paths; when given, the drafts are those paths instead.
    """

    def __init__(self, heads, num_heads: int, top_k: int = 1, num_drafts: int = 1, rescorer: Rescorer | None = None,
                 tree_choices: list[tuple[int, ...]] | None = None):
        self.heads = heads
        self.num_heads = num_heads
        self.top_k = top_k
        self.num_drafts = num_drafts
        self.rescorer = rescorer or HeadScoreRescorer()
        self.tree_choices = tree_choices
        if tree_choices:
            self.top_k = max(top_k, 1 + max(r for c in tree_choices for r in c))

    def max_block_length(self) -> int:
        """The most tokens one verification pass can hold: the last token plus every draft node."""
        if self.tree_choices is not None:
            return 1 + len(self.tree_choices)
        return 1 + self.num_heads * self.num_drafts

    @torch.no_grad()
    def lattice(self, hidden: torch.Tensor, num_heads: int | None = None) -> Lattice:
        logits = self.heads.step_logits(hidden, num_heads or self.num_heads)
        return Lattice.from_head_logits(logits, self.top_k, self.heads.to_vocab_ids)

    @torch.no_grad()
    def drafts(self, hidden: torch.Tensor, context: list[int], max_length: int) -> list[tuple[int, ...]]:
        """Draft token sequences (at most `max_length` tokens each) following `context`, best first."""
        n = min(self.num_heads, max_length)
        if n <= 0:
            return []
        if self.tree_choices is None and self.top_k == 1 and type(self.rescorer) is HeadScoreRescorer:
            # Plain BPD: the argmax of each head, no lattice needed.
            best = self.heads.step_logits(hidden, n).argmax(-1)
            return [tuple(self.heads.to_vocab_ids(best).tolist())]
        lattice = self.lattice(hidden, n)
        if self.tree_choices is not None:
            return [lattice.path_tokens(c) for c in self.tree_choices if len(c) <= n]
        return [d.tokens[:n] for d in self.rescorer.rescore(lattice, context, self.num_drafts)]


class NoDrafter:
    """Drafts nothing: the decoding loop then takes one plain step per token (`use_heads=False, compile=True`)."""

    def max_block_length(self) -> int:
        return 1

    def drafts(self, hidden, context, max_length) -> list:
        return []
