"""Configuration of a blockwise parallel decoding (BPD) heads checkpoint, for `trust_remote_code=True` loading.

Written into the checkpoint by `hf_bpd.hub.remote_code.write_remote_code`; it needs torch and transformers only
(hf_bpd need not be installed). The fields are those of `hf_bpd.BlockwiseParallelConfig`.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

HEAD_TYPES = ("ffn", "resblock", "hydra")


class BlockwiseParallelConfig(PretrainedConfig):
    r"""
    A causal base model plus `num_heads` drafting heads; head `i` (1-based) reads the base's last hidden state at
    position `t` (the input of its output layer) and predicts token `t + 1 + i`.

    Args:
        num_heads, head_type (`"ffn"`, `"resblock"`, `"hydra"`), num_layers_per_head, head_intermediate_size,
        tie_head_projection, draft_vocab_size, head_loss_weights: the heads' shape (see hf_bpd's docs).
        base_model_name_or_path (`str`): the base the heads were trained on, as hf_bpd names it (a local directory,
            a Hub id, or an hf_bpd packaged alias).
        base_model_hub_id (`str`): what this remote code loads the base from (the alias's Hub id, else
            `base_model_name_or_path`).
        base_model_fingerprint (`str`): a fingerprint of the base's weights (a mismatch only warns here).
        text_config (`dict` or `PretrainedConfig`): the base model's config.
        rescorers, base_adapter, head_calibration: hf_bpd extras, kept but not used by the remote code.
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
        base_model_hub_id: str | None = None,
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
        if head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head_type {head_type!r}: use one of {', '.join(HEAD_TYPES)}")
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")
        self.num_heads = num_heads
        self.head_type = head_type
        self.num_layers_per_head = num_layers_per_head
        self.head_intermediate_size = head_intermediate_size
        self.tie_head_projection = tie_head_projection
        # Old checkpoints kept the draft vocabulary's ids here; new ones keep them in heads.safetensors.
        self.draft_vocab = None if draft_vocab is None else [int(i) for i in draft_vocab]
        self.draft_vocab_size = len(self.draft_vocab) if self.draft_vocab is not None else draft_vocab_size
        self.head_loss_weights = [1.0] * num_heads if head_loss_weights is None else list(head_loss_weights)
        self.base_model_name_or_path = base_model_name_or_path
        self.base_model_hub_id = base_model_hub_id
        self.base_model_fingerprint = base_model_fingerprint
        for legacy in ("draft_top_k", "num_drafts", "rescorer", "rescorer_alpha"):  # old decoding settings
            kwargs.pop(legacy, None)
        self.rescorers = rescorers or {}
        self.base_adapter = base_adapter
        self.head_calibration = head_calibration
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

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
        return out
