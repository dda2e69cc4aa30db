"""The verification forward pass: one base forward over the last token and a draft tree, and the KV-cache rollback.

Two verifiers share one interface (`prefill`, `verify`, `keep`, `close`), so the decoding loop is the same for both:

* `EagerVerifier` (here) runs the base as it is, on the `DynamicCache` transformers prepared for the call.
* `CompiledVerifier` (`hf_bpd.runtime.compiled_verifier`, `generate(..., compile=True)`) runs a compiled step on a reused
  static cache: the base's artifact for this machine (`hf_bpd.runtime.artifacts`), else `torch.compile`;
  `compiled_verifier` below decides whether it can serve a call (while an artifact is being built in the
  background, calls verify eagerly).

If compiling fails, or the base cannot use it (sliding-window layers, a non-decoder layout), generation falls back to
the eager verifier with a one-line warning.
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import DynamicCache

from ..kv_cache import CACHE_NAME
from ..runtime.attention import grouped_query_attention, uses_grouped_attention
from ..runtime import artifacts, background
from ..runtime.compiled import ArtifactRunner, compiled_runner
from ..runtime.compiled_verifier import CompiledVerifier
from ..runtime.step import compile_unsupported_reason
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


def compiled_verifier(model, needed_length: int, attention_mask=None, wait: bool = False):
    """`(CompiledVerifier, runner)` for one call, or `None` when the call verifies eagerly: with a one-line warning
    when the compiled step cannot serve this base or call, silently while the base's artifact is being built in the
    background (`hf_bpd.runtime.background`, which announces the build once). With `wait`, a missing artifact is
    built here first; bases that artifacts cannot serve (and `HF_BPD_OFF=artifacts`) compile with `torch.compile`."""
    base = model.base_lm
    reason = compile_unsupported_reason(base)
    if reason is None and attention_mask is not None:
        reason = "an attention mask was given"
    if reason is not None:
        warnings.warn(f"hf_bpd: compile=True is not used for this call ({reason}); decoding eagerly", stacklevel=4)
        return None
    artifact, log = None, lambda line: background.logger.warning("hf_bpd: %s", line)
    if artifacts.enabled() and artifacts.unsupported_reason(base) is None:
        if wait:
            artifact = artifacts.ensure(base, log=log)
        else:
            artifact = background.ready_artifact(base)
            if artifact is None:
                return None
    runner = compiled_runner(base, needed_length, artifact)
    if isinstance(runner, ArtifactRunner):
        runner.blocking = wait
        eight = None
        if artifacts.eight_tokens_unsupported_reason(base) is None:  # AVX2: blocks of 8 on a graph of their own
            eight = (artifacts.ensure(base, log=log, graph=artifacts.EIGHT_TOKENS) if wait
                     else background.ready_artifact(base, artifacts.EIGHT_TOKENS))
        runner.attach_eight_tokens(eight)
    return CompiledVerifier(model, runner), runner
