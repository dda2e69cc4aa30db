# Copied from hf_bpd/heads.py by hf_bpd.hub.remote_code.write_remote_code: edit that file.
"""Drafting heads: small blocks on the base's last hidden state, one per future position (paper Sec. 4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from .configuration_bpd import BlockwiseParallelConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"



@dataclass
class BlockwiseParallelOutput(ModelOutput):
    """
    Args:
        loss: `sum_h lambda_h * L_h` (+ `base_loss_weight * base_loss`), when `labels` were given.
        base_loss: next-token cross-entropy of the base model, when `labels` were given.
        head_losses: `(num_heads,)` cross-entropy of each head, when `labels` were given.
        logits: `(batch, seq, vocab)` base next-token logits (positions cut by `logits_to_keep` as in the base).
        head_logits: `(batch, num_heads, seq, draft_vocab_size)`: head `h` at position `t` scores token `t + 1 + h`.
        last_hidden_state: `(batch, seq, hidden)` the input of the base's output layer, which the heads read.
        cache (`past_key_values` before transformers 5.24), hidden_states, attentions: as returned by the base model.
    """

    loss: torch.FloatTensor | None = None
    base_loss: torch.FloatTensor | None = None
    head_losses: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    head_logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    if CACHE_NAME == "cache":
        cache: object | None = None
    else:
        past_key_values: object | None = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The base's own next-token cross-entropy of `logits` `(batch, seq, vocab)` on `labels` (-100 ignored); 0 (with a
    gradient path) when every label is ignored."""
    shifted = logits[:, :-1]
    if not bool((labels[:, 1:] != -100).any()):
        return shifted.sum() * 0.0
    return nn.functional.cross_entropy(shifted.reshape(-1, shifted.shape[-1]).float(), labels[:, 1:].reshape(-1),
                                       ignore_index=-100)


def heads_placement(base_model) -> dict:
    """Where the heads live: on the device of the base's output layer (the last stage under a `device_map`; the heads
    read its input and share its weights) and in its dtype; fp32 when that layer holds no floating-point weights."""
    layer = base_model.get_output_embeddings()
    weight = layer.weight
    if not weight.is_floating_point() and hasattr(layer, "dequantized_weight"):  # hf_bpd's int8 weights: bf16
        return {"device": weight.device, "dtype": layer.weight_scale.dtype}
    return {"device": weight.device, "dtype": weight.dtype if weight.is_floating_point() else torch.float32}


class ResBlock(nn.Module):
    """Medusa's residual block `x + SiLU(W x)`. W starts at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class FFNBlock(nn.Module):
    """Stern et al.'s one-hidden-layer FFN with a residual connection: `x + W2 ReLU(W1 x)`.

    W2 starts at zero (W1 random), so a fresh block is the identity and the head starts as the base's next-token
    head; training moves it from there.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, init_std: float = 0.02, input_size: int | None = None):
        super().__init__()
        self.up = nn.Linear(input_size or hidden_size, intermediate_size)
        self.down = nn.Linear(intermediate_size, hidden_size)
        nn.init.normal_(self.up.weight, std=init_std)
        nn.init.zeros_(self.up.bias)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class SequentialBlock(FFNBlock):
    """A Hydra-style (Ankner et al. 2024) sequentially dependent block: `x + W2 ReLU(W1 [x; e])`, where `e` is the
    input embedding of the block's previous token (for head 1 the base's own next token, for head `i` the token head
    `i - 1` drafted) and `x` the previous head's state (for head 1 the base's hidden state). W2 starts at zero."""

    def __init__(self, hidden_size: int, intermediate_size: int, init_std: float = 0.02):
        super().__init__(hidden_size, intermediate_size, init_std, input_size=2 * hidden_size)

    def forward(self, x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(torch.cat([x, embedding], dim=-1))))


class DraftHead(nn.Module):
    """One head: `num_layers_per_head` blocks, then (optionally) its own output projection.

    With a tied projection the head returns hidden states and `DraftHeads` applies the base's output embedding.
    A `"hydra"` head's first block also reads the embedding of its previous token (`forward(x, embedding)`).
    """

    def __init__(self, config: BlockwiseParallelConfig, init_projection: torch.Tensor | None):
        super().__init__()
        d = config.hidden_size
        self.reads_token = config.head_type == "hydra"
        if config.head_type == "resblock":
            blocks = [ResBlock(d) for _ in range(config.num_layers_per_head)]
        else:
            width = config.head_intermediate_size or d
            std = getattr(config.text_config, "initializer_range", 0.02)
            blocks = [FFNBlock(d, width, std) for _ in range(config.num_layers_per_head)]
            if self.reads_token:
                blocks[0] = SequentialBlock(d, width, std)
        # A fresh module per layer: never `[block] * n`, which would tie the layers.
        self.blocks = nn.Sequential(*blocks)
        self.projection = None
        if not config.tie_head_projection:
            self.projection = nn.Linear(d, config.draft_size, bias=False)
            if init_projection is not None:
                with torch.no_grad():
                    self.projection.weight.copy_(init_projection)

    def forward(self, hidden: torch.Tensor, embedding: torch.Tensor | None = None) -> torch.Tensor:
        if not self.reads_token:
            return self.blocks(hidden)
        hidden = self.blocks[0](hidden, embedding)
        for block in self.blocks[1:]:
            hidden = block(hidden)
        return hidden


class DraftHeads(nn.Module):
    """All `num_heads` heads plus the shared (tied) output projection.

    `forward(hidden)` maps hidden states `(batch, seq, hidden_size)` to head logits
    `(batch, num_heads, seq, draft_vocab_size)`; `to_vocab_ids` maps draft-vocabulary indices to token ids.

    Sequential (`head_type="hydra"`) heads also read tokens: head `i` at position `t` reads head `i - 1`'s state and
    the input embedding of token `t + 1 + i` (for head 1: the base's own next token `t + 1`). At drafting time those
    are the drafted tokens (`step_logits(hidden, next_token=...)`: each head reads the previous head's argmax); in
    training and analysis they are the sequence's tokens (teacher forcing: `forward(hidden, tokens=input_ids)`,
    `loss(...)` reads them from the labels).
    """

    def __init__(self, config: BlockwiseParallelConfig, output_embeddings: nn.Module,
                 input_embeddings: nn.Module | None = None):
        super().__init__()
        self.config = config
        # The base's output layer is shared, never copied: it is looked up at call time (a tied or LoRA'd lm_head
        # keeps working) and is not part of this module's state dict. So are its input embeddings (hydra heads).
        self._output_embeddings = [output_embeddings]
        self._input_embeddings = [input_embeddings]
        self.sequential = config.head_type == "hydra"
        if self.sequential and input_embeddings is None:
            raise ValueError("hydra heads read the base's input embeddings: pass input_embeddings=")
        self._projection_cache = None  # (key, draft-vocabulary rows of the output layer) at inference
        # The draft vocabulary's token ids are part of the heads' state (saved in heads.safetensors).
        if config.draft_vocab_size is not None:
            ids = (torch.tensor(config.draft_vocab, dtype=torch.long) if config.draft_vocab is not None
                   else torch.zeros(config.draft_vocab_size, dtype=torch.long))  # filled by load_state_dict
            self.register_buffer("draft_vocab", ids)
        else:
            self.draft_vocab = None
        init = None
        if not config.tie_head_projection:
            init = self._base_projection_weight().detach()
        self.heads = nn.ModuleList(DraftHead(config, init) for _ in range(config.num_heads))
        softcap = getattr(config.text_config, "final_logit_softcapping", None)
        self.logit_softcapping = float(softcap) if softcap else None

    def _base_projection_weight(self) -> torch.Tensor:
        layer = self._output_embeddings[0]
        weight = layer.weight
        int8 = not weight.is_floating_point() and hasattr(layer, "dequantized_weight")  # hf_bpd's int8 weights
        if self.draft_vocab is None and not int8:
            return weight
        if torch.is_grad_enabled() and weight.requires_grad:  # training through the output layer: no caching
            return weight.index_select(0, self.draft_vocab.to(weight.device))
        # Inference: project onto the draft vocabulary once, not once per step (the selected rows are 19 MB for
        # SmolLM2's 8k draft vocabulary); rebuilt if the output layer's weights or the vocabulary change.
        vocab = self.draft_vocab
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device,
               *((vocab.data_ptr(), vocab._version) if vocab is not None else ()))
        if self._projection_cache is None or self._projection_cache[0] != key:
            # an int8 layer's rows dequantized (the values the layer computes with), only the draft vocabulary's
            with torch.no_grad():
                if int8:
                    rows = layer.dequantized_weight(vocab)
                else:
                    rows = weight if vocab is None else weight.index_select(0, vocab.to(weight.device))
            self._projection_cache = (key, rows)
        return self._projection_cache[1]

    def _base_projection_bias(self) -> torch.Tensor | None:
        bias = getattr(self._output_embeddings[0], "bias", None)
        if bias is None or self.draft_vocab is None:
            return bias
        return bias.index_select(0, self.draft_vocab.to(bias.device))

    def project(self, index: int, head_hidden: torch.Tensor) -> torch.Tensor:
        """Logits of head `index` (0-based) over the draft vocabulary from that head's hidden states."""
        head = self.heads[index]
        if head.projection is not None:
            logits = head.projection(head_hidden)
        elif self.draft_vocab is None:
            logits = self._output_embeddings[0](head_hidden)
        else:
            logits = nn.functional.linear(head_hidden, self._base_projection_weight(), self._base_projection_bias())
        if self.logit_softcapping is not None:
            logits = torch.tanh(logits / self.logit_softcapping) * self.logit_softcapping
        return logits

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The base's input embeddings of `token_ids` (what sequential heads read), in the heads' dtype."""
        dtype = next(self.heads.parameters()).dtype
        return self._input_embeddings[0](token_ids).to(dtype)

    def head_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of head `index` for base hidden states `hidden` of shape `(..., hidden_size)` (independent heads)."""
        return self.project(index, self.heads[index](hidden))

    def states(self, hidden: torch.Tensor, num_heads: int, tokens: torch.Tensor | None = None
               ) -> list[torch.Tensor]:
        """Each head's output state `(batch, seq, hidden_size)` (before the output projection).

        Sequential heads read `tokens` (`(batch, seq)`, the sequence's token ids; teacher forcing): head `i`
        (0-based) at position `t` reads token `t + 1 + i`; positions whose token lies past the end read token 0
        (their outputs are not meaningful)."""
        if not self.sequential:
            return [self.heads[i](hidden) for i in range(num_heads)]
        if tokens is None:
            raise ValueError("hydra heads read the sequence's tokens: pass tokens= (the input ids)")
        length = hidden.shape[1]
        state, out = hidden, []
        for i in range(num_heads):
            following = tokens[:, 1 + i: 1 + i + length].clamp(min=0)
            following = nn.functional.pad(following, (0, length - following.shape[1]))
            state = self.heads[i](state, self.embed(following))
            out.append(state)
        return out

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`(batch, seq, hidden_size)` -> `(batch, num_heads, seq, draft_vocab_size)` (`tokens`: see `states`)."""
        n = len(self.heads) if num_heads is None else num_heads
        return torch.stack([self.project(i, state) for i, state in enumerate(self.states(hidden, n, tokens))], dim=1)

    def step_logits(self, hidden: torch.Tensor, num_heads: int | None = None,
                    next_token: int | torch.Tensor | None = None) -> torch.Tensor:
        """Drafting-time logits `(num_heads, draft_vocab_size)` for one hidden state `(hidden_size,)`.

        With a tied projection all heads share one matrix product (the projection is most of a head's cost).
        Sequential heads run one after the other from `next_token` (the base's own next token), each reading the
        previous head's argmax."""
        n = len(self.heads) if num_heads is None else num_heads
        if self.sequential:
            if next_token is None:
                raise ValueError("hydra heads draft from the base's next token: pass next_token=")
            token = torch.as_tensor(next_token, device=hidden.device)
            state, rows = hidden, []
            for i in range(n):
                state = self.heads[i](state, self.embed(token))
                rows.append(self.project(i, state))
                token = self.to_vocab_ids(rows[-1].argmax(-1))
            return torch.stack(rows)
        if self.heads[0].projection is not None:
            return torch.stack([self.head_logits(i, hidden) for i in range(n)])
        return self.project(0, torch.stack([self.heads[i](hidden) for i in range(n)]))

    def to_vocab_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map indices into the draft vocabulary to base token ids (identity without a draft vocabulary)."""
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, weights, num_heads: int | None = None,
             return_stats: bool = False, soft_weight: float = 0.0, temperature: float = 1.0):
        """The BPD training loss (paper App. C.1): `sum_i weights[i] * L_i`, head `i` (0-based) at position `t`
        scored on `labels[t + 2 + i]` (labels of -100 and tokens outside the draft vocabulary are ignored).

        `L_i` is the cross-entropy on that token; with `soft_weight` w > 0 it is `(1 - w) CE + w T^2 KL(p_T || q_T)`:
        soft targets, the base's own next-token distribution at position `t + 1 + i` (its output layer applied to
        `hidden`, restricted to the draft vocabulary, temperature T) against the head's. Sequential (hydra) heads
        read the labels as their tokens (teacher forcing); a position is scored only when every token its head reads
        is a label.

        Returns `(loss, per-head losses)`, plus `[(positions, top-1 hits, top-5 hits)]` per head with `return_stats`.
        Only the scored positions go through the heads' output projection.
        """
        n = len(self.heads) if num_heads is None else num_heads
        length = hidden.shape[1]
        states = self.states(hidden, n, labels) if self.sequential else None
        readable = labels != -100
        losses, stats = [], []
        for i in range(n):
            shift = i + 2
            targets = self.to_draft_ids(labels[:, shift:])
            keep = targets != -100
            if self.sequential:  # the tokens it reads, labels[t + 1 .. t + 1 + i], must be real too
                for j in range(1, i + 2):
                    keep = keep & readable[:, j: j + length - shift]
            if not keep.any():
                losses.append(hidden.sum() * 0.0)  # still part of the graph
                stats.append((0, 0, 0))
                continue
            if self.sequential:
                logits = self.project(i, states[i][:, : length - shift][keep])
            else:
                logits = self.head_logits(i, hidden[:, : length - shift][keep])
            head_loss = nn.functional.cross_entropy(logits.float(), targets[keep])
            if soft_weight > 0:
                with torch.no_grad():  # the base's distribution of token t + 2 + i, from its hidden state at t + 1 + i
                    teacher = self.project_base(hidden[:, i + 1: length - 1][keep]).float()
                kl = nn.functional.kl_div((logits.float() / temperature).log_softmax(-1),
                                          (teacher / temperature).log_softmax(-1), log_target=True,
                                          reduction="batchmean")
                head_loss = (1 - soft_weight) * head_loss + soft_weight * temperature ** 2 * kl
            losses.append(head_loss)
            if return_stats:
                top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                stats.append((int(keep.sum()), int((top5[:, 0] == targets[keep]).sum()),
                              int((top5 == targets[keep][:, None]).any(-1).sum())))
        losses = torch.stack(losses)
        loss = (torch.tensor(list(weights)[:n], dtype=losses.dtype, device=losses.device) * losses).sum()
        return (loss, losses, stats) if return_stats else (loss, losses)

    def project_base(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base's own next-token logits from its hidden states, over the draft vocabulary."""
        logits = nn.functional.linear(hidden, self._base_projection_weight(), self._base_projection_bias())
        if self.logit_softcapping is not None:
            logits = torch.tanh(logits / self.logit_softcapping) * self.logit_softcapping
        return logits

    def to_draft_ids(self, token_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Map base token ids to draft-vocabulary indices; ids outside the draft vocabulary become `ignore_index`."""
        if self.draft_vocab is None:
            return token_ids
        table = torch.full((self.config.vocab_size,), ignore_index, dtype=torch.long, device=token_ids.device)
        table[self.draft_vocab.to(token_ids.device)] = torch.arange(len(self.draft_vocab), device=token_ids.device)
        safe = token_ids.clamp(min=0)
        return torch.where(token_ids < 0, token_ids, table[safe])
