"""The verification forward pass: one base forward over the last token and a draft tree, and the KV-cache rollback.

Two verifiers share one interface (`prefill`, `verify`, `keep`, `close`), so the decoding loop is the same for both:

* `EagerVerifier` (here) runs the base as it is, on the `DynamicCache` transformers prepared for the call.
* the runtime's compiled verifier (`hf_bpd.runtime.execution.compiled_verification`, `generate(..., compile=True)`)
  runs a compiled step on a reused static cache; it decides whether it can serve a call (while the step for this
  machine is being built in the background, calls verify eagerly).

If compiling fails, or the base cannot use it (sliding-window layers, a non-decoder layout), generation falls back to
the eager verifier with a one-line warning.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from ..kv_cache import CACHE_NAME
from ..runtime.execution import grouped_query_attention, uses_grouped_attention
from .tree import DraftTree, keep_accepted, tree_attention_masks


class EagerVerifier:
    """Verification with the base as it is, on a `DynamicCache`."""

    kind = "eager"
    reused = 0  # prompt tokens not run by `prefill` (a compiled verifier's cache may hold them)

    def __init__(self, model, cache, attention_mask=None):
        self.model, self.base = model, model.base_lm
        self.cache = cache if cache is not None else DynamicCache(config=self.base.config.get_text_config(decoder=True))
        self.cache.activate_past_recording()  # sliding-window layers keep what a rollback needs
        text_config = self.base.config.get_text_config(decoder=True)
        self.layer_types = getattr(text_config, "layer_types", None)
        self.sliding_window = getattr(text_config, "sliding_window", None)
        self.attention_mask = attention_mask
        self.grouped = uses_grouped_attention(self.base)

    def prefill(self, input_ids: torch.Tensor, all_positions: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt pass: `(logits (1, vocab), hidden (hidden_size,))` at the last prompt position
        (`all_positions`: the hidden states of every prompt position, `(n, hidden_size)`)."""
        extra = {"output_hidden_states": True} if all_positions else {}  # the last entry: the final (normed) one
        with grouped_query_attention(self.base, self.grouped):
            out = self.model(input_ids=input_ids, attention_mask=self.attention_mask, **{CACHE_NAME: self.cache},
                             use_cache=True, return_head_logits=False, logits_to_keep=1, **extra)
        return out.logits[:, -1], out.hidden_states[-1][0] if all_positions else out.last_hidden_state[0, -1]

    def verify(self, last_token: int, tree: DraftTree, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward `[last_token] + tree.tokens`: `(logits (q, vocab), hidden (q, hidden_size))`."""
        past = self.cache.get_seq_length()
        block = torch.tensor([[last_token] + tree.tokens], dtype=torch.long, device=device)
        with grouped_query_attention(self.base, self.grouped):
            if tree.is_chain():  # the ordinary causal mask and positions
                out = self.model(input_ids=block, **{CACHE_NAME: self.cache}, use_cache=True,
                                 return_head_logits=False)
            else:
                mask = tree_attention_masks(tree, self.cache, past, self.layer_types, self.sliding_window,
                                            self.base.dtype, device)
                positions = (past + tree.block_depths()).to(device)[None]
                out = self.model(input_ids=block, attention_mask=mask, position_ids=positions,
                                 **{CACHE_NAME: self.cache}, use_cache=True, return_head_logits=False)
        return out.logits[0], out.last_hidden_state[0]

    def keep(self, block_length: int, kept: list[int]) -> None:
        """Keep block positions `kept` (the root and the accepted path) of the last verification; drop the rest."""
        keep_accepted(self.cache, block_length, kept)

    def close(self, length: int, sequence: torch.Tensor | None = None) -> object:
        """The cache after decoding `length` tokens (it holds `length - 1`)."""
        if self.cache.get_seq_length() > length - 1:
            self.cache.crop(-(self.cache.get_seq_length() - (length - 1)))
        return self.cache
