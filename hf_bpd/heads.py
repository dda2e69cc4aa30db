"""Drafting heads: small blocks on the base's last hidden state, one per future position (paper Sec. 4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from .configuration import BlockwiseParallelConfig


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
        past_key_values, hidden_states, attentions: as returned by the base model.
    """

    loss: torch.FloatTensor | None = None
    base_loss: torch.FloatTensor | None = None
    head_losses: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    head_logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    past_key_values: object | None = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None


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

    def __init__(self, hidden_size: int, intermediate_size: int, init_std: float = 0.02):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size)
        self.down = nn.Linear(intermediate_size, hidden_size)
        nn.init.normal_(self.up.weight, std=init_std)
        nn.init.zeros_(self.up.bias)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class DraftHead(nn.Module):
    """One head: `num_layers_per_head` blocks, then (optionally) its own output projection.

    With a tied projection the head returns hidden states and `DraftHeads` applies the base's output embedding.
    """

    def __init__(self, config: BlockwiseParallelConfig, init_projection: torch.Tensor | None):
        super().__init__()
        d = config.hidden_size
        if config.head_type == "resblock":
            blocks = [ResBlock(d) for _ in range(config.num_layers_per_head)]
        else:
            width = config.head_intermediate_size or d
            std = getattr(config.text_config, "initializer_range", 0.02)
            blocks = [FFNBlock(d, width, std) for _ in range(config.num_layers_per_head)]
        # A fresh module per layer: never `[block] * n`, which would tie the layers.
        self.blocks = nn.Sequential(*blocks)
        self.projection = None
        if not config.tie_head_projection:
            self.projection = nn.Linear(d, config.draft_size, bias=False)
            if init_projection is not None:
                with torch.no_grad():
                    self.projection.weight.copy_(init_projection)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.blocks(hidden)


class DraftHeads(nn.Module):
    """All `num_heads` heads plus the shared (tied) output projection.

    `forward(hidden)` maps hidden states `(batch, seq, hidden_size)` to head logits
    `(batch, num_heads, seq, draft_vocab_size)`; `to_vocab_ids` maps draft-vocabulary indices to token ids.
    """

    def __init__(self, config: BlockwiseParallelConfig, output_embeddings: nn.Module):
        super().__init__()
        self.config = config
        # The base's output layer is shared, never copied: it is looked up at call time (a tied or LoRA'd lm_head
        # keeps working) and is not part of this module's state dict.
        self._output_embeddings = [output_embeddings]
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
        weight = self._output_embeddings[0].weight
        if self.draft_vocab is None:
            return weight
        if torch.is_grad_enabled() and weight.requires_grad:  # training through the output layer: no caching
            return weight.index_select(0, self.draft_vocab.to(weight.device))
        # Inference: project onto the draft vocabulary once, not once per step (the selected rows are 19 MB for
        # SmolLM2's 8k draft vocabulary); rebuilt if the output layer's weights or the vocabulary change.
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, self.draft_vocab.data_ptr(),
               self.draft_vocab._version)
        if self._projection_cache is None or self._projection_cache[0] != key:
            with torch.no_grad():
                rows = weight.index_select(0, self.draft_vocab.to(weight.device))
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

    def head_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of head `index` for base hidden states `hidden` of shape `(..., hidden_size)`."""
        return self.project(index, self.heads[index](hidden))

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """`(batch, seq, hidden_size)` -> `(batch, num_heads, seq, draft_vocab_size)`."""
        n = len(self.heads) if num_heads is None else num_heads
        return torch.stack([self.head_logits(i, hidden) for i in range(n)], dim=1)

    def step_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Drafting-time logits `(num_heads, draft_vocab_size)` for one hidden state `(hidden_size,)`.

        With a tied projection all heads share one matrix product (the projection is most of a head's cost).
        """
        n = len(self.heads) if num_heads is None else num_heads
        if self.heads[0].projection is not None:
            return torch.stack([self.head_logits(i, hidden) for i in range(n)])
        return self.project(0, torch.stack([self.heads[i](hidden) for i in range(n)]))

    def to_vocab_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map indices into the draft vocabulary to base token ids (identity without a draft vocabulary)."""
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, weights, num_heads: int | None = None,
             return_stats: bool = False):
        """The BPD training loss (paper App. C.1): `sum_i weights[i] * CE_i`, head `i` (0-based) at position `t`
        scored on `labels[t + 2 + i]` (labels of -100 and tokens outside the draft vocabulary are ignored).

        Returns `(loss, per-head losses)`, plus `[(positions, top-1 hits, top-5 hits)]` per head with `return_stats`.
        Only the scored positions go through the heads' output projection.
        """
        n = len(self.heads) if num_heads is None else num_heads
        losses, stats = [], []
        for i in range(n):
            shift = i + 2
            targets = self.to_draft_ids(labels[:, shift:])
            keep = targets != -100
            if not keep.any():
                losses.append(hidden.sum() * 0.0)  # still part of the graph
                stats.append((0, 0, 0))
                continue
            logits = self.head_logits(i, hidden[:, : hidden.shape[1] - shift][keep])
            losses.append(nn.functional.cross_entropy(logits.float(), targets[keep]))
            if return_stats:
                top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                stats.append((int(keep.sum()), int((top5[:, 0] == targets[keep]).sum()),
                              int((top5 == targets[keep][:, None]).any(-1).sum())))
        losses = torch.stack(losses)
        loss = (torch.tensor(list(weights)[:n], dtype=losses.dtype, device=losses.device) * losses).sum()
        return (loss, losses, stats) if return_stats else (loss, losses)

    def to_draft_ids(self, token_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Map base token ids to draft-vocabulary indices; ids outside the draft vocabulary become `ignore_index`."""
        if self.draft_vocab is None:
            return token_ids
        table = torch.full((self.config.vocab_size,), ignore_index, dtype=torch.long, device=token_ids.device)
        table[self.draft_vocab.to(token_ids.device)] = torch.arange(len(self.draft_vocab), device=token_ids.device)
        safe = token_ids.clamp(min=0)
        return torch.where(token_ids < 0, token_ids, table[safe])
