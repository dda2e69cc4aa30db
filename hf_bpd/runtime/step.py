"""The unit every compiled verification runs: the base's decoder and output layer over a block on a static cache,
and which bases it can serve (`compile=True`'s `torch.compile`d steps and the ahead-of-time artifacts alike)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import StaticCache

from ..kv_cache import CACHE_NAME


class VerificationStep(nn.Module):
    """The base's decoder and output layer as one module (with the base's final logit soft-capping): the unit
    `torch.compile` freezes (`compiled`) and the artifacts export (`artifacts`)."""

    def __init__(self, base, cache: StaticCache):
        super().__init__()
        self.base = base
        self.cache = cache
        softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
        self.softcap = float(softcap) if softcap else None

    def forward(self, input_ids, position_ids, cache_position, attention_mask):
        hidden = self.base.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                         cache_position=cache_position, attention_mask=attention_mask,
                                         **{CACHE_NAME: self.cache}, use_cache=True).last_hidden_state
        logits = self.base.get_output_embeddings()(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits, hidden


def compile_unsupported_reason(base) -> str | None:
    """Why a compiled step (in-process or an artifact) cannot serve `base` (None when it can)."""
    text_config = base.config.get_text_config(decoder=True)
    if any(t != "full_attention" for t in (getattr(text_config, "layer_types", None) or ["full_attention"])):
        return "its sliding-window layers need a rolling cache"
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True) \
            and getattr(text_config, "layer_types", None) is None and "mistral" in text_config.model_type:
        return "its sliding-window layers need a rolling cache"
    try:
        base.get_decoder(), base.get_output_embeddings()
    except Exception:  # noqa: BLE001
        return "it has no decoder / output layer to compile"
    if getattr(base, "hf_quantizer", None) is not None:
        return "quantized weights cannot be frozen"
    return None
