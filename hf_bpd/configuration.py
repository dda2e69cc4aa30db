"""`BlockwiseParallelConfig`: what the drafting heads look like and which base model they belong to."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from .errors import BPDConfigError

HEAD_TYPES = ("ffn", "resblock")


class BlockwiseParallelConfig(PretrainedConfig):
    r"""
    Configuration of a blockwise parallel LM: a causal base model plus `num_heads` drafting heads.

    Head `i` (1-based) reads the base model's last hidden state at position `t` (the input of the base's output
    layer) and predicts token `t + 1 + i`; the base itself predicts `t + 1`. A decoding step therefore drafts a block
    of `num_heads + 1` tokens.

    Args:
        num_heads (`int`): number of drafting heads (>= 1).
        head_type (`str`): `"ffn"` (Stern et al. 2018: one hidden layer FFN with a residual connection) or
            `"resblock"` (Medusa: residual `x + SiLU(W x)` blocks). Both are zero-initialised on their output side,
            so a fresh head predicts exactly what the base's next-token head predicts.
        num_layers_per_head (`int`): blocks stacked in each head.
        head_intermediate_size (`int`, *optional*): hidden width of an `"ffn"` head (default: the base's hidden size).
        tie_head_projection (`bool`): heads share the base's output embedding (`True`) or own a projection
            initialised from it (`False`).
        draft_vocab (`list[int]`, *optional*): token ids the heads score over. Restricting heads to frequent tokens
            cuts the cost of the output projection, which dominates a head on small models.
        head_loss_weights (`list[float]`, *optional*): the paper's λ_h (App. C.1); default 1.0 for every head.
        base_model_name_or_path (`str`): what `hf_bpd.load_base` loads when no base model is passed.
        base_model_fingerprint (`str`): `hf_bpd.fingerprint(base)` of the base the heads were trained on.
        text_config (`dict` or `PretrainedConfig`): the base model's config (used for caches and validation).
        draft_top_k, num_drafts, rescorer, rescorer_alpha: default decoding settings for `generate()`.
        rescorers (`dict`): rescorers bundled with the checkpoint, by name (`"ngram"`, `"neural"`): each a dict with
            the file/directory `path` (relative to the checkpoint), the tuned interpolation weight `alpha`, and
            type-specific fields (`order`; `type`, `num_layers`).
        base_adapter (`str`, *optional*): a peft LoRA adapter for the base (Medusa-2 training), merged into the base
            on load.
    """

    model_type = "blockwise_parallel"
    sub_configs = {"text_config": AutoConfig}

    def __init__(
        self,
        num_heads: int = 4,
        head_type: str = "resblock",
        num_layers_per_head: int = 1,
        head_intermediate_size: int | None = None,
        tie_head_projection: bool = True,
        draft_vocab: list[int] | None = None,
        head_loss_weights: list[float] | None = None,
        base_model_name_or_path: str | None = None,
        base_model_fingerprint: str | None = None,
        text_config: dict | PretrainedConfig | None = None,
        draft_top_k: int | None = None,
        num_drafts: int = 1,
        rescorer: str | None = None,
        rescorer_alpha: float | None = None,
        rescorers: dict | None = None,
        base_adapter: str | None = None,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = dict(text_config)
            text_config = AutoConfig.for_model(text_config.pop("model_type"), **text_config)
        self.text_config = text_config
        self.num_heads = num_heads
        self.head_type = head_type
        self.num_layers_per_head = num_layers_per_head
        self.head_intermediate_size = head_intermediate_size
        self.tie_head_projection = tie_head_projection
        self.draft_vocab = None if draft_vocab is None else [int(i) for i in draft_vocab]
        self.head_loss_weights = (
            [1.0] * num_heads if head_loss_weights is None else [float(w) for w in head_loss_weights]
        )
        self.base_model_name_or_path = base_model_name_or_path
        self.base_model_fingerprint = base_model_fingerprint
        self.draft_top_k = draft_top_k
        self.num_drafts = num_drafts
        self.rescorer = rescorer
        self.rescorer_alpha = rescorer_alpha
        self.rescorers = rescorers or {}
        self.base_adapter = base_adapter
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.validate_heads()

    # The base's sizes, read through so they cannot drift from the base config.
    @property
    def hidden_size(self) -> int | None:
        return None if self.text_config is None else self.text_config.hidden_size

    @property
    def vocab_size(self) -> int | None:
        return None if self.text_config is None else self.text_config.vocab_size

    @property
    def block_size(self) -> int:
        """Tokens drafted per step: the base's next token plus one per head."""
        return self.num_heads + 1

    @property
    def draft_vocab_size(self) -> int | None:
        return len(self.draft_vocab) if self.draft_vocab is not None else self.vocab_size

    def validate_heads(self) -> None:
        """Raise `BPDConfigError` (one line, naming the fix) when the head settings are inconsistent."""
        if not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise BPDConfigError(f"num_heads must be an integer >= 1, got {self.num_heads!r}")
        if self.head_type not in HEAD_TYPES:
            raise BPDConfigError(f"unknown head_type {self.head_type!r}: use one of {', '.join(HEAD_TYPES)}")
        if not isinstance(self.num_layers_per_head, int) or self.num_layers_per_head < 1:
            raise BPDConfigError(f"num_layers_per_head must be an integer >= 1, got {self.num_layers_per_head!r}")
        if self.head_intermediate_size is not None and self.head_intermediate_size < 1:
            raise BPDConfigError(f"head_intermediate_size must be >= 1, got {self.head_intermediate_size}")
        if len(self.head_loss_weights) != self.num_heads or any(w < 0 for w in self.head_loss_weights):
            raise BPDConfigError(
                f"head_loss_weights must hold {self.num_heads} non-negative numbers (one per head), "
                f"got {self.head_loss_weights}"
            )
        if self.draft_vocab is not None:
            if len(self.draft_vocab) == 0:
                raise BPDConfigError("draft_vocab is empty: pass at least one token id, or None for the full vocabulary")
            if len(set(self.draft_vocab)) != len(self.draft_vocab):
                raise BPDConfigError("draft_vocab has repeated token ids: pass each id once")
            if self.vocab_size is not None:
                bad = [i for i in self.draft_vocab if not 0 <= i < self.vocab_size]
                if bad:
                    raise BPDConfigError(
                        f"draft_vocab holds token ids outside the base vocabulary [0, {self.vocab_size}): "
                        f"{bad[:5]}{' ...' if len(bad) > 5 else ''}; pass ids from the base tokenizer"
                    )
        if self.draft_top_k is not None and (not isinstance(self.draft_top_k, int) or self.draft_top_k < 1):
            raise BPDConfigError(f"draft_top_k must be an integer >= 1, got {self.draft_top_k!r}")
        for name, spec in self.rescorers.items():
            if name not in ("ngram", "neural") or not isinstance(spec, dict) or "path" not in spec:
                raise BPDConfigError(f"bad bundled rescorer {name!r}: rescorers maps 'ngram'/'neural' to "
                                     "{'path': ..., 'alpha': ...}")
            if float(spec.get("alpha", 1.0)) < 0:
                raise BPDConfigError(f"the {name} rescorer's alpha must be >= 0, got {spec['alpha']}")
        if not isinstance(self.num_drafts, int) or self.num_drafts < 1:
            raise BPDConfigError(f"num_drafts must be an integer >= 1, got {self.num_drafts!r}")
