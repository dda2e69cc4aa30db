"""Drafting with a feature-level drafter (`hf_bpd.feature_drafter`) inside the decoding loop:
`generate(drafter="feature")`.

The drafter keeps its own KV cache over the decoded sequence: one entry per position j, read from the base's feature
`f_j` and token j+1. The prompt pass gives the prompt's features; every verification gives those of the last token
and the accepted drafts (`observe`). From the newest entry the drafter drafts a chain of `depth` tokens
autoregressively, each depth reading the hidden state it predicted at the depth before, on a temporary extension of
its cache that is cut off again after the step. With `prompt_lookup` the context's own continuation of its last
n-gram is verified with the chain in the same pass, as with the heads. Verification is eager or compiled as for the
heads; a compiled prompt pass then runs over the whole prompt (the drafter needs every position's feature), not only
over what the cache does not hold from the last call.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .drafting import Drafter
from .lookup import prompt_lookup


class FeatureChainDrafter(Drafter):
    """See the module docstring. `drafter`: a `FeatureDrafter` on the base's device and dtype."""

    reads_features = True
    one_prompt = True  # its cache follows one sequence

    def __init__(self, drafter, depth: int = 4, prompt_lookup: bool = False):
        self.drafter, self.depth, self.prompt_lookup = drafter, depth, prompt_lookup
        self.cache: DynamicCache | None = None
        self.state: torch.Tensor | None = None  # (1, 1, hidden): the drafter's hidden state at the newest entry
        self.length = 0  # cache entries (= positions whose feature and next token were read)

    def max_block_length(self) -> int:
        return 1 + self.depth * (2 if self.prompt_lookup else 1)

    @torch.no_grad()
    def start(self, features: torch.Tensor, input_ids: torch.Tensor, first_token: int) -> None:
        """The prompt pass: the base's features `(n, hidden)` at the prompt's positions, the prompt `(1, n)` and the
        token the prompt pass decoded."""
        self.cache = DynamicCache(config=self.drafter.config)
        self.length = 0
        tokens = torch.cat([input_ids[0, 1:], torch.tensor([first_token], device=input_ids.device)])
        self._read(features, tokens)

    @torch.no_grad()
    def observe(self, block_hidden: torch.Tensor, kept: list[int], tokens: list[int]) -> None:
        """After a verification: the base's features at the kept block positions (the root, then the accepted
        drafts) and the token that followed each (the accepted drafts, then the base's own next token)."""
        features = block_hidden[torch.tensor(kept, device=block_hidden.device)]
        self._read(features, torch.tensor(tokens[:len(kept)], device=block_hidden.device))

    def _read(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        n = features.shape[0]
        positions = torch.arange(self.length, self.length + n, device=features.device)[None]
        dtype = self.drafter.fuse.weight.dtype
        hidden = self.drafter(features.to(dtype)[None], next_tokens[None], positions, self.cache)
        self.state, self.length = hidden[:, -1:], self.length + n

    @torch.no_grad()
    def drafts(self, hidden, context: list[int], max_length: int) -> tuple[list[tuple[int, ...]], list[float]]:
        """The chain (at most `max_length` tokens) and, with prompt lookup, the copy; and the chain's draft
        probabilities. `hidden` (the base's feature at the newest entry) is already in the drafter's cache."""
        depth = min(self.depth, max_length)
        if depth <= 0:
            return [], []
        drafter, state = self.drafter, self.state
        chain, probs = [], []
        for d in range(depth):
            best = torch.softmax(drafter.logits(state)[0, -1].float(), -1).max(-1)
            token = drafter.to_vocab_ids(best.indices)
            chain.append(int(token))
            probs.append(float(best.values))
            if d + 1 < depth:
                position = torch.tensor([[self.length + d]], device=state.device)
                state = drafter(state, token.view(1, 1), position, self.cache)
        extra = self.cache.get_seq_length() - self.length
        if extra > 0:
            self.cache.crop(-extra)
        drafts = [tuple(chain)]
        if self.prompt_lookup:
            copied = prompt_lookup(context, depth)
            if copied and tuple(chain[:len(copied)]) != copied:
                drafts.append(copied)
        return drafts, probs
