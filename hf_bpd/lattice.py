"""The top-k "sausage" lattice of one drafting step (paper Sec. 7): k candidate tokens for each head."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draft:
    """One path through a lattice: `tokens` (token ids, one per head used) and its `score` (higher is better)."""

    tokens: tuple[int, ...]
    score: float


class Lattice:
    """Top-k tokens of every head at one decoding step.

    Attributes:
        tokens: `(num_heads, k)` token ids (base vocabulary), best first in each row.
        logprobs: `(num_heads, k)` head log-probabilities of those tokens (over the head's full draft vocabulary).
    Row `i` holds the candidates for the token `i + 1` steps after the base's own next token.
    """

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor):
        if tokens.shape != logprobs.shape or tokens.dim() != 2:
            raise ValueError(f"tokens and logprobs must both be (num_heads, k), got {tuple(tokens.shape)} and "
                             f"{tuple(logprobs.shape)}")
        self.tokens = tokens
        self.logprobs = logprobs
        self._probs: list[dict[int, float]] | None = None

    @classmethod
    def from_head_logits(cls, head_logits: torch.Tensor, k: int, to_vocab_ids=None) -> "Lattice":
        """Build from `(num_heads, draft_vocab)` logits; `to_vocab_ids` maps draft-vocabulary indices to token ids."""
        logprobs = torch.log_softmax(head_logits.float(), dim=-1)
        top = logprobs.topk(k, dim=-1)
        tokens = top.indices if to_vocab_ids is None else to_vocab_ids(top.indices)
        return cls(tokens.cpu(), top.values.cpu())

    @property
    def num_heads(self) -> int:
        return self.tokens.shape[0]

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    def path_score(self, ranks: tuple[int, ...]) -> float:
        return float(sum(self.logprobs[i, r] for i, r in enumerate(ranks)))

    def path_tokens(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(self.tokens[i, r]) for i, r in enumerate(ranks))

    def token_probs(self, tokens: tuple[int, ...]) -> list[float]:
        """The heads' probabilities of `tokens` (one per head, in order; 0 for a token outside a head's top-k)."""
        if self._probs is None:  # per head, token -> probability (the first, i.e. best, rank of a repeated token)
            probs = self.logprobs.float().exp().tolist()
            self._probs = [dict(zip(reversed(row), reversed(p))) for row, p in zip(self.tokens.tolist(), probs)]
        return [self._probs[i].get(int(token), 0.0) for i, token in enumerate(tokens[: self.num_heads])]

    def best_paths(self, p: int) -> list[Draft]:
        """The `p` highest-scoring paths under the heads alone (the paper's "p-best 0-gram" drafts), best first.

        Exact: paths are rank vectors; the best is all zeros and every other path is reached from a better one by
        raising one rank, so a heap over successors enumerates them in score order (each visited once).
        """
        h, k = self.tokens.shape
        lp = self.logprobs.tolist()
        start = (0,) * h
        heap = [(-sum(row[0] for row in lp), start)]
        seen = {start}
        out: list[Draft] = []
        while heap and len(out) < p:
            neg, ranks = heapq.heappop(heap)
            out.append(Draft(self.path_tokens(ranks), -neg))
            for i in range(h):
                if ranks[i] + 1 < k:
                    nxt = ranks[:i] + (ranks[i] + 1,) + ranks[i + 1:]
                    if nxt not in seen:
                        seen.add(nxt)
                        score = -neg - lp[i][ranks[i]] + lp[i][ranks[i] + 1]
                        heapq.heappush(heap, (-score, nxt))
        return out

    def paths(self):
        """Every path (k ** num_heads of them) as `Draft`s, unsorted: for small lattices and brute-force checks."""
        for ranks in itertools.product(range(self.k), repeat=self.num_heads):
            yield Draft(self.path_tokens(ranks), self.path_score(ranks))

    def oracle_path(self, reference: list[int]) -> tuple[int, ...]:
        """The longest prefix of `reference` that the lattice contains (each token within its head's top-k)."""
        path = []
        for i, token in enumerate(reference[: self.num_heads]):
            if token not in self.tokens[i].tolist():
                break
            path.append(int(token))
        return tuple(path)
