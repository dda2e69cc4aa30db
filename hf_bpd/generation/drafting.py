"""Block drafting (paper Alg. 1, stage 1): heads -> top-k lattice -> rescorer -> draft(s)."""

from __future__ import annotations

import torch

from ..lattice import Lattice
from ..rescorers.base import HeadScoreRescorer, Rescorer
from .budget import HeadCalibration, acceptance_rates, best_first_nodes
from .lookup import prompt_lookup


class BlockDrafter:
    """Drafts from one base hidden state with the first `num_heads` heads.

    Args:
        heads: the model's `DraftHeads`.
        num_heads: heads to use (block size = num_heads + 1).
        top_k: lattice width (candidates per head).
        num_drafts: drafts returned per step (p-best); 1 for chain decoding.
        rescorer: picks drafts from the lattice; `HeadScoreRescorer` (head scores only) by default.
        tree_choices: Medusa-style rank paths; when given, the drafts are those paths instead.
        prompt_lookup: also draft the context's own continuation of its last n-gram (`hf_bpd.generation.lookup`),
            verified with the heads' drafts in the same pass: one more path, as long as the heads' drafts, unless a
            node budget is in effect.
        draft_nodes: a budget of draft nodes per verification (`slots`). The heads' drafts (their `num_drafts` best
            paths, each a chain of tokens) and the copy then compete for the budget best-first
            (`best_first_nodes`: the nodes likeliest to be accepted, from the calibrated head confidences, a path
            rank's measured discount and prompt lookup's measured acceptance rates), so every step verifies one
            block of `1 + draft_nodes` tokens. Under compiled verification a chain with prompt lookup gets
            `hf_bpd.runtime.compiled.COMPILED_DRAFT_SLOTS` nodes when none is given (set by the decoding loop).
    """

    def __init__(self, heads, num_heads: int, top_k: int = 1, num_drafts: int = 1, rescorer: Rescorer | None = None,
                 tree_choices: list[tuple[int, ...]] | None = None, prompt_lookup: bool = False,
                 draft_nodes: int | None = None):
        self.heads = heads
        self.num_heads = num_heads
        self.top_k = top_k
        self.num_drafts = num_drafts
        self.rescorer = rescorer or HeadScoreRescorer()
        self.tree_choices = tree_choices
        self.prompt_lookup = prompt_lookup
        self.head_top = None  # (hidden, next token) -> (top-k log-probs, indices) of every head; set when compiled
        self.calibration: HeadCalibration | None = None  # measured acceptance rates (`hf-bpd calibrate`)
        # `draft_schedule="cost"` with a node budget: chances of the likeliest nodes -> how many to verify (set by the
        # decoding loop, `DraftBudget.choose_nodes`); None: the whole budget
        self.node_count = None
        # The draft nodes one step verifies, filled best-first from the drafts and the copy: `draft_nodes`, or, for a
        # compiled chain with prompt lookup, the compiled block's length minus its root (set by the decoding loop,
        # `hf_bpd.runtime.compiled.COMPILED_DRAFT_SLOTS`). None: every drafted token is verified.
        if draft_nodes is not None and not prompt_lookup:  # no more nodes than the paths hold (a compiled block
            draft_nodes = min(draft_nodes, num_heads * num_drafts)  # is padded to its budget)
        self.draft_nodes = draft_nodes  # the budget in effect (what `slots` returns to if compiling fails)
        self.slots: int | None = draft_nodes
        if tree_choices:
            self.top_k = max(top_k, 1 + max(r for c in tree_choices for r in c))

    def max_block_length(self) -> int:
        """The most tokens one verification pass can hold: the last token plus every draft node."""
        if self.shares_slots():
            return 1 + self.slots
        lookup = self.num_heads if self.prompt_lookup else 0
        if self.tree_choices is not None:
            return 1 + len(self.tree_choices) + lookup
        return 1 + self.num_heads * self.num_drafts + lookup

    def shares_slots(self) -> bool:
        """A node budget: the drafts and the copy compete for `slots` draft nodes."""
        return self.slots is not None and self.tree_choices is None

    @torch.no_grad()
    def lattice(self, hidden: torch.Tensor, num_heads: int | None = None, next_token: int | None = None) -> Lattice:
        """The top-k lattice of the heads from `hidden`; sequential (hydra) heads read `next_token` (the base's next
        token) and then each other's argmax, so their lattice is conditioned on the heads' greedy path."""
        logits = self.heads.step_logits(hidden, num_heads or self.num_heads, next_token)
        return Lattice.from_head_logits(logits, self.top_k, self.heads.to_vocab_ids)

    @torch.no_grad()
    def drafts(self, hidden: torch.Tensor, context: list[int], max_length: int
               ) -> tuple[list[tuple[int, ...]], list[float]]:
        """Draft token sequences (at most `max_length` tokens each) following `context`, best first (the prompt-lookup
        path, if any, last), and the heads' probabilities of the best draft's tokens (what `draft_schedule="cost"`
        weighs)."""
        drafts, probs = self.head_drafts(hidden, context, max_length)
        best = probs[0] if probs else []
        if self.shares_slots() and drafts:  # every draft and the copy compete for the budget's nodes
            calibration = self.calibration or HeadCalibration.default()
            paths = [(d, [r * calibration.rank_factor(rank) for r in acceptance_rates(self.calibration, p)])
                     for rank, (d, p) in enumerate(zip(drafts, probs))]
            copied = prompt_lookup(context, min(self.slots, max_length)) if self.prompt_lookup else ()
            if copied:
                paths.append((copied, calibration.lookup_rates(len(copied))))
            return best_first_nodes(paths, self.slots, self.node_count), best
        if self.prompt_lookup and drafts:  # one more path
            copied = prompt_lookup(context, max(len(d) for d in drafts))
            if copied and not any(d[: len(copied)] == copied for d in drafts):
                drafts.append(copied)
        return drafts, best

    @torch.no_grad()
    def head_drafts(self, hidden: torch.Tensor, context: list[int], max_length: int
                    ) -> tuple[list[tuple[int, ...]], list[list[float]]]:
        """The heads' drafts (see `drafts`) and the heads' probabilities of each draft's tokens (for a tree: of the
        top-1 path's)."""
        n = min(self.num_heads, max_length)
        if n <= 0:
            return [], []
        plain = self.tree_choices is None and self.top_k == 1 and type(self.rescorer) is HeadScoreRescorer
        if self.head_top is not None:  # the compiled heads step (generate(compile=True))
            values, indices = self.head_top(hidden, context[-1])
            values, indices = values[:n, : self.top_k].cpu(), indices[:n, : self.top_k]
            if plain:
                return [tuple(self.heads.to_vocab_ids(indices[:, 0]).tolist())], [values[:, 0].exp().tolist()]
            lattice = Lattice(self.heads.to_vocab_ids(indices).cpu(), values)
        elif plain:  # Plain BPD: the argmax of each head, no lattice needed.
            best = torch.softmax(self.heads.step_logits(hidden, n, context[-1]).float(), dim=-1).max(-1)
            return [tuple(self.heads.to_vocab_ids(best.indices).tolist())], [best.values.tolist()]
        else:
            lattice = self.lattice(hidden, n, context[-1])
        if self.tree_choices is not None:
            drafts = [lattice.path_tokens(c) for c in self.tree_choices if len(c) <= n]
            return drafts, [lattice.logprobs[:, 0].exp().tolist()]  # the top-1 path's
        drafts = [d.tokens[:n] for d in self.rescorer.rescore(lattice, context, self.num_drafts)]
        return drafts, [lattice.token_probs(d) for d in drafts]


class NoDrafter:
    """Drafts nothing: the decoding loop then takes one plain step per token (`use_heads=False, compile=True`)."""

    def max_block_length(self) -> int:
        return 1

    def drafts(self, hidden, context, max_length) -> tuple[list, list]:
        return [], []
