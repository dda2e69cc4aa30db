"""Block drafting (paper Alg. 1, stage 1): heads -> top-k lattice -> rescorer -> draft(s).

`BlockDraftCandidateGenerator` plugs the drafter into transformers' own assisted-generation loop: it receives the
last verification pass's outputs through the documented `requires_model_outputs` route (as `MTPCandidateGenerator`
does) and drafts from the hidden state that produced the last accepted token, with no extra base forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .lattice import Lattice
from .rescoring import HeadScoreRescorer, Rescorer


@dataclass
class GenerationStats:
    """What one `generate()` call did. `model.last_generation_stats` holds the latest.

    `serial_calls` counts every base forward pass of the call, the one over the prompt included (it decodes the
    first token), so plain decoding has `block_efficiency == 1.0` exactly. `accepted_lengths[i]` is the number of
    draft tokens accepted by serial call `i` (0 for the prompt pass); each call also decodes one token of its own,
    so `block_efficiency == new_tokens / serial_calls == 1 + mean(accepted_lengths)` (the paper's definition).
    """

    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)  # tokens sent to verification per call (tree nodes)
    draft_seconds: float = 0.0
    total_seconds: float = 0.0
    method: str = "chain"

    @property
    def serial_calls(self) -> int:
        return len(self.accepted_lengths)

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.serial_calls if self.serial_calls else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean draft tokens accepted per verification call (the prompt pass excluded)."""
        steps = self.accepted_lengths[1:]
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def verify_seconds(self) -> float:
        """Time outside drafting: base forward passes, acceptance and bookkeeping."""
        return max(self.total_seconds - self.draft_seconds, 0.0)

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "new_tokens": self.new_tokens,
            "serial_calls": self.serial_calls,
            "block_efficiency": self.block_efficiency,
            "mean_accepted": self.mean_accepted,
            "accepted_lengths": list(self.accepted_lengths),
            "draft_tokens": list(self.draft_tokens),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
        }


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


class BlockDraftCandidateGenerator(CandidateGenerator):
    """Chain drafting inside transformers' `_assisted_decoding` (greedy and sampling).

    Drafts are deterministic (argmax or rescored), so no candidate logits are returned: transformers then verifies
    by comparing against the base's own greedy choice, or against a token sampled from the base distribution, which
    is exact speculative sampling for a one-hot draft distribution.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict = {}

    def __init__(self, drafter: BlockDrafter, stats: GenerationStats, max_length: int):
        self.drafter = drafter
        self.stats = stats
        self.max_length = max_length
        self.last_block = 0  # tokens drafted for the verification pass now running

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs=None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0, **kwargs):
        """`input_ids` `(1, seq)` -> `(1, seq + draft_length)` candidates, and `None` logits."""
        if is_first_iteration:  # the prompt pass drafts nothing: its hidden state is what we draft from next
            self.last_block = 0
            self.stats.draft_tokens.append(0)
            return input_ids, None
        start = time.perf_counter()
        hidden_states = model_outputs.last_hidden_state[0]
        # The last pass kept logits (and hidden states) for [last token, drafted tokens]; the state at offset
        # n_last_matches is the one that produced the token just accepted.
        hidden = hidden_states[hidden_states.shape[0] - (self.last_block + 1) + n_last_matches]
        room = self.max_length - input_ids.shape[1] - 1
        drafts = self.drafter.drafts(hidden, input_ids[0].tolist(), room)
        draft = drafts[0] if drafts else ()
        self.last_block = len(draft)
        self.stats.draft_tokens.append(len(draft))
        self.stats.draft_seconds += time.perf_counter() - start
        if not draft:
            return input_ids, None
        tail = torch.tensor([draft], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, tail], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.stats.accepted_lengths.append(int(num_matches))
