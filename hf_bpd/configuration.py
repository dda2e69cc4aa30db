"""`BlockwiseParallelConfig`: what the drafting heads look like and which base model they belong to."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from .errors import BPDConfigError

HEAD_TYPES = ("ffn", "resblock", "hydra")


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
            so a fresh head predicts exactly what the base's next-token head predicts. `"hydra"`: sequentially
            dependent FFN heads (Ankner et al. 2024): head `i` also reads the previous head's state and the input
            embedding of the token before its own (the base's next token for head 1, head `i - 1`'s draft after that).
        num_layers_per_head (`int`): blocks stacked in each head.
        head_intermediate_size (`int`, *optional*): hidden width of an `"ffn"` head (default: the base's hidden size).
        tie_head_projection (`bool`): heads share the base's output embedding (`True`) or own a projection
            initialised from it (`False`).
        draft_vocab_size (`int`, *optional*): size of the draft vocabulary, the token ids the heads score over
            (None: the full vocabulary). Restricting heads to frequent tokens cuts the cost of the output projection,
            which dominates a head on small models. The ids themselves are stored with the heads' weights
            (`heads.safetensors`, tensor `draft_vocab`), not here.
        draft_vocab (`list[int]`, *optional*): the draft vocabulary's token ids when building fresh heads
            (`from_base(..., draft_vocab=ids)`); read from old checkpoints' config.json; never written to it.
        head_loss_weights (`list[float]`, *optional*): the paper's λ_h (App. C.1); default 1.0 for every head.
        base_model_name_or_path (`str`): what `hf_bpd.load_base` loads when no base model is passed.
        base_model_fingerprint (`str`): `hf_bpd.fingerprint(base)` of the base the heads were trained on.
        text_config (`dict` or `PretrainedConfig`): the base model's config (used for caches and validation).
        rescorers (`dict`): rescorers bundled with the checkpoint, by registered name (`"ngram"`, `"neural"`, ...):
            each a dict with the file/directory `path` (relative to the checkpoint), the tuned interpolation weight
            `alpha`, and type-specific fields (`order`; `type`, `num_layers`).

    Decoding settings (`rescorer`, `draft_top_k`, `num_drafts`, ...) are generation options: they live in the
    checkpoint's `generation_config.json` (`hf_bpd.BlockwiseGenerationConfig`). Old checkpoints that kept them here
    still load (`legacy_generation_options`).
        base_adapter (`str`, *optional*): a peft LoRA adapter for the base (Medusa-2 training), merged into the base
            on load.
        head_calibration (`dict`, *optional*): measured acceptance rate of each head's drafted token per confidence
            bin (`{"edges": [...], "accept": [[...] per head]}`), written by `hf-bpd calibrate` and read by
            `draft_schedule="cost"` (`hf_bpd.generation.controller`).
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
        draft_vocab_size: int | None = None,
        draft_vocab: list[int] | None = None,
        head_loss_weights: list[float] | None = None,
        base_model_name_or_path: str | None = None,
        base_model_fingerprint: str | None = None,
        text_config: dict | PretrainedConfig | None = None,
        rescorers: dict | None = None,
        base_adapter: str | None = None,
        head_calibration: dict | None = None,
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
        if self.draft_vocab is not None:
            if draft_vocab_size is not None and draft_vocab_size != len(self.draft_vocab):
                raise BPDConfigError(f"draft_vocab_size={draft_vocab_size} but draft_vocab holds {len(self.draft_vocab)} "
                                     "ids: pass one of them")
            draft_vocab_size = len(self.draft_vocab)
        self.draft_vocab_size = draft_vocab_size
        try:
            self.head_loss_weights = (
                [1.0] * (num_heads if isinstance(num_heads, int) else 0) if head_loss_weights is None
                else [float(w) for w in head_loss_weights]
            )
        except (TypeError, ValueError):
            raise BPDConfigError(f"head_loss_weights must be a list of numbers (one per head), got "
                                 f"{head_loss_weights!r}") from None
        self.base_model_name_or_path = base_model_name_or_path
        self.base_model_fingerprint = base_model_fingerprint
        # Decoding settings that old checkpoints kept here; from_pretrained moves them to the generation config.
        self.legacy_generation_options = {k: kwargs.pop(k) for k in ("draft_top_k", "num_drafts", "rescorer")
                                          if k in kwargs}
        kwargs.pop("rescorer_alpha", None)
        self.rescorers = rescorers or {}
        self.base_adapter = base_adapter
        self.head_calibration = head_calibration
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
    def draft_size(self) -> int | None:
        """Tokens a head scores over: the draft vocabulary's size, else the base vocabulary's."""
        return self.draft_vocab_size if self.draft_vocab_size is not None else self.vocab_size

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("draft_vocab", None)  # stored with the heads' weights
        out.pop("legacy_generation_options", None)
        return out

    def validate_heads(self) -> None:
        """Raise `BPDConfigError` (one line, naming the fix) when the head settings are inconsistent."""
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise BPDConfigError(f"num_heads must be an integer >= 1, got {self.num_heads!r}")
        if self.head_type not in HEAD_TYPES:
            raise BPDConfigError(f"unknown head_type {self.head_type!r}: use one of {', '.join(HEAD_TYPES)}")
        if not isinstance(self.num_layers_per_head, int) or self.num_layers_per_head < 1:
            raise BPDConfigError(f"num_layers_per_head must be an integer >= 1, got {self.num_layers_per_head!r}")
        if self.head_intermediate_size is not None and (isinstance(self.head_intermediate_size, bool) or not
                                                        isinstance(self.head_intermediate_size, int) or
                                                        self.head_intermediate_size < 1):
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
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int) or not
                                                  1 <= self.draft_vocab_size <= (self.vocab_size or 1 << 62)):
            raise BPDConfigError(f"draft_vocab_size must be an integer in [1, {self.vocab_size}] (the base vocabulary), "
                                 f"got {self.draft_vocab_size!r}")
        if self.head_calibration is not None:
            from .generation.calibration import HeadCalibration

            HeadCalibration.from_dict(self.head_calibration)  # raises a one-line error when malformed
        from .rescorers.registry import available_rescorers

        if not isinstance(self.rescorers, dict):
            raise BPDConfigError(f"rescorers must map rescorer names to {{'path': ..., 'alpha': ...}}, got "
                                 f"{type(self.rescorers).__name__}")
        for name, spec in self.rescorers.items():
            if name not in available_rescorers() or not isinstance(spec, dict) or "path" not in spec:
                raise BPDConfigError(f"bad bundled rescorer {name!r}: rescorers maps a registered rescorer name "
                                     f"({', '.join(available_rescorers())}) to {{'path': ..., 'alpha': ...}}")
            alpha = spec.get("alpha", 1.0)
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
                raise BPDConfigError(f"the {name} rescorer's alpha must be a number >= 0, got {alpha!r}")
