"""A feature-level drafter (EAGLE-style): one decoder layer that drafts autoregressively over the base's features.

The drafting heads (`hf_bpd.heads`) predict token t+i from the base's hidden state at t alone: head i never sees the
tokens between. A feature-level drafter conditions on what it drafts. At position j it reads the base's feature
`f_j` (the final hidden state, what the output layer reads) fused with the embedding of token j+1:

    x_j = fuse([embed(token_{j+1}); f_j])           (2 * hidden -> hidden)
    h_j = norm(layer(x_j | x_{<j}))                  (one decoder layer of the base's own class, causal, its own KV
                                                      cache, and a final norm: h_j lives where f_j does)
    p(token_{j+2}) = softmax(output(h_j))            (the base's frozen output rows over the draft vocabulary)

and `h_j` stands in for the base's feature `f_{j+1}` at the next drafting depth (training regresses it onto
`f_{j+1}`), so drafting d tokens costs d passes of one layer. The embedding, the output rows and the rotary tables
are the base's, frozen and not stored; the fuse projection, the layer and the norm are the drafter's (the layer and
the norm start as copies of the base's last ones).

With `feature_layers` (EAGLE-3's fused features) the feature it reads at a base position is not `f_j` alone but
`lift([f_j; rms(a_j^l1); rms(a_j^l2); ...])` (`(1 + k) * hidden -> hidden`), the residual stream after the named
lower decoder layers (each RMS-normalised, parameter-free) beside the final feature; `lift` starts as the identity on
`f_j`, so a fused drafter starts as the plain one. Drafted positions read the drafter's own hidden state, as before.

`hf_bpd.training.train_drafter` trains it on extracted features (`hf_bpd.training.features`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from .kv_cache import CACHE_NAME
from .runtime.int8_weights import float_state_dict, float_weight


def decoder_of(base) -> nn.Module:
    """The base's decoder stack (`model.model` for most causal LMs)."""
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    if not hasattr(decoder, "layers"):
        raise ValueError(f"{type(base).__name__} has no decoder layer list: a feature-level drafter needs a "
                         "decoder-only base with model.layers")
    return decoder


class FeatureDrafter(nn.Module):
    """See the module docstring. `draft_vocab`: the token ids the drafter predicts over (None: the whole
    vocabulary); `feature_layers`: lower decoder layers (0-based) whose outputs are fused with the final feature."""

    def __init__(self, base, draft_vocab: torch.Tensor | None = None, feature_layers: Sequence[int] = ()):
        super().__init__()
        decoder = decoder_of(base)
        feature_layers = [int(i) for i in feature_layers]
        depth = len(decoder.layers)
        if any(not 0 <= i < depth - 1 for i in feature_layers) or len(set(feature_layers)) != len(feature_layers):
            raise ValueError(f"feature_layers {feature_layers}: distinct decoder layers 0..{depth - 2} of this "
                             f"{depth}-layer base (its last layer's output is the final feature, always read)")
        text = base.config.get_text_config(decoder=True)
        config = copy.deepcopy(text)
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = ["full_attention"]
        self.config = config
        hidden = text.hidden_size
        self.fuse = nn.Linear(2 * hidden, hidden, bias=True)
        nn.init.normal_(self.fuse.weight, std=0.02)
        nn.init.zeros_(self.fuse.bias)
        last = decoder.layers[-1]
        self.layer = type(last)(config, layer_idx=0)
        self.layer.load_state_dict(float_state_dict(last))  # (an int8 base's layer dequantized)
        self.norm = copy.deepcopy(decoder.norm)
        self.lift = None
        if feature_layers:
            self.lift = nn.Linear((1 + len(feature_layers)) * hidden, hidden, bias=False)
            with torch.no_grad():  # the identity on the final feature: a fused drafter starts as the plain one
                self.lift.weight.zero_()
                self.lift.weight[:, :hidden] = torch.eye(hidden)
        self.to(base.dtype)
        self.register_buffer("draft_vocab", None if draft_vocab is None else draft_vocab.clone().long(),
                             persistent=True)
        self.register_buffer("feature_layers", torch.tensor(feature_layers, dtype=torch.long) if feature_layers
                             else None, persistent=True)
        self._layers = feature_layers  # the same, as a list (no device reads while drafting)
        # the base's frozen pieces, kept out of this module's parameters (not trained, not saved)
        self._frozen = {"embed": base.get_input_embeddings(), "output": base.get_output_embeddings(),
                        "rotary": decoder.rotary_emb}

    @classmethod
    def load(cls, folder, base) -> FeatureDrafter:
        """A drafter saved by `save` (`drafter.safetensors` in `folder`), for `base`."""
        from pathlib import Path

        from safetensors.torch import load_file

        state = load_file(str(Path(folder) / "drafter.safetensors"))
        layers = state.get("feature_layers")
        drafter = cls(base, state.get("draft_vocab"), [] if layers is None else layers.tolist())
        drafter.load_state_dict(state)
        return drafter.eval()

    def save(self, folder, dtype: torch.dtype | None = torch.bfloat16) -> None:
        """`drafter.safetensors` in `folder`: the drafter's own weights (in `dtype`; None: as they are) and its draft
        vocabulary."""
        from pathlib import Path

        from safetensors.torch import save_file

        Path(folder).mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", dtype if dtype is not None and v.is_floating_point() else v.dtype)
                 .contiguous() for k, v in self.state_dict().items() if v is not None}
        save_file(state, str(Path(folder) / "drafter.safetensors"))

    def layers_read(self) -> list[int]:
        """The base layers whose outputs this drafter reads: -1 (the final, normed feature), then `feature_layers`."""
        return [-1] + self._layers

    def read_features(self, states: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> torch.Tensor:
        """The feature this drafter reads at base positions, `(..., hidden)` in its dtype, from the base's hidden
        states: a mapping `hidden_<i>` (as `hf_bpd.training.features` names them) or the tuple a forward with
        `output_hidden_states=True` returns (the embeddings, every layer's output, the last one normed)."""
        def state(i):
            if isinstance(states, Mapping):
                return states[f"hidden_{i}"]
            return states[-1] if i == -1 else states[i + 1]

        dtype = self.fuse.weight.dtype
        final = state(-1).to(dtype)
        if self.lift is None:
            return final
        parts = [final] + [nn.functional.rms_norm(state(i).to(dtype), (final.shape[-1],), eps=1e-6)
                           for i in self._layers]
        return self.lift(torch.cat(parts, dim=-1))

    def output_weight(self) -> torch.Tensor:
        """The output layer's draft-vocabulary rows (gathered once while the output layer's weight is unchanged;
        in training, gathered every time, so its gradient path stays intact)."""
        layer = self._frozen["output"]
        weight = layer.weight  # int8 for an int8 output layer (`hf_bpd.runtime.int8_weights`): dequantized below
        if self.draft_vocab is None and weight.is_floating_point():
            return weight
        if self.training or torch.is_grad_enabled():
            return float_weight(layer, self.draft_vocab)
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype,
               None if self.draft_vocab is None else self.draft_vocab.data_ptr())
        cached = self._frozen.get("rows")
        if cached is None or cached[0] != key:  # keyed by the stored weight: an int8 layer is dequantized once
            cached = self._frozen["rows"] = (key, float_weight(layer, self.draft_vocab))
        return cached[1]

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor,
                cache=None) -> torch.Tensor:
        """`features (B, T, hidden)` at positions `position_ids (B, T)`, `next_tokens (B, T)` the token after each:
        the drafter's hidden states `(B, T, hidden)` (each stands for the base's feature one position later).
        With `cache` (a `DynamicCache`) the layer attends to the positions it holds too."""
        embed = self._frozen["embed"](next_tokens).to(features.dtype)
        x = self.fuse(torch.cat([embed, features], dim=-1))
        rotary = self._frozen["rotary"](x, position_ids=position_ids)
        mask = None
        if cache is not None:
            mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None,
                                      **{CACHE_NAME: cache}, position_ids=position_ids)
        return self.norm(self.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary,
                                    use_cache=cache is not None, **{CACHE_NAME: cache}))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the drafter's hidden states (the output layer reads them as it reads the
        base's features)."""
        return nn.functional.linear(hidden, self.output_weight())

    def to_vocab_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]
