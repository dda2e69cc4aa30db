"""`BlockwiseParallelForCausalLM`: any causal LM plus drafting heads, saved and loaded on its own.

The model class only loads, saves and runs the heads; decoding lives in `hf_bpd.generation`, rescorers in
`hf_bpd.rescorers`, checkpoint files in `hf_bpd.hub`.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.utils import logging

from .configuration import BlockwiseParallelConfig
from .errors import BaseModelError, BPDConfigError
from .generation.config import BlockwiseGenerationConfig, drafting_options, load_generation_config
from .generation.decoding import blockwise_decoding, call_option, check_inputs, plan_call, transformers_only
from .generation.stats import GenerationStats, finish_stats
from .generation.stopping import stop_strings_as_criteria
from .heads import CACHE_NAME, BlockwiseParallelOutput, DraftHeads, heads_placement, next_token_loss
from .runtime.artifacts import preload as preload_artifact
from .runtime.int8_weights import quantize_int8_weights, split_int8_weights
from .hub.bundled import (BundledRescorers, attach_rescorer, bundle_fields, inside, load_bundled,
                          load_feature_drafter, load_heads_config, merge_base_adapter)
from .hub.base_models import (check_causal_lm, check_fingerprint, default_base_dtype, fingerprint, int8_weights_file,
                               load_base_model)
from .hub.checkpoints import check_heads_header, load_heads_state, push_saved, resolve_checkpoint_dir, save_checkpoint

logger = logging.get_logger(__name__)


class BlockwiseParallelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal base model (`base_lm`) with `config.num_heads` drafting heads (`heads`).

    Build fresh heads with `from_base(...)`; load saved heads with `from_pretrained(dir)`. `save_pretrained` writes
    only the config and the heads: the base is named (and fingerprinted) in the config, never copied.
    """

    config_class = BlockwiseParallelConfig
    base_model_prefix = "base_lm"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def __init__(self, config: BlockwiseParallelConfig, base_model: PreTrainedModel | None = None):
        super().__init__(config)
        if base_model is None:
            if config.text_config is None:
                raise BaseModelError("no base model: use BlockwiseParallelForCausalLM.from_base(base, ...) or "
                                     "from_pretrained(dir)")
            # Randomly initialised base of the configured architecture (AutoModel.from_config); real bases come
            # through from_base / from_pretrained.
            base_model = AutoModelForCausalLM.from_config(config.text_config)
        check_causal_lm(base_model)
        if config.text_config is None:
            config.text_config = copy.deepcopy(base_model.config)
        for field in ("hidden_size", "vocab_size"):
            want, have = getattr(config, field), getattr(base_model.config.get_text_config(), field, None)
            if want != have:
                raise BaseModelError(f"the heads' config has {field}={want} but the base model has {have}: load "
                                     "the base model the heads were built for")
        config.validate_heads()
        self.base_lm = base_model
        self.heads = DraftHeads(config, base_model.get_output_embeddings(), base_model.get_input_embeddings())
        self.heads.to(**heads_placement(base_model))
        self.generation_config = BlockwiseGenerationConfig.from_base(base_model.generation_config)
        self.last_generation_stats: GenerationStats | None = None
        self.bundled_rescorers = BundledRescorers()  # name -> Rescorer of this checkpoint, loaded on first use
        self._feature_drafter: list = []  # a FeatureDrafter, held outside the module tree (not in the state dict)
        self._bundle_sources: dict[str, Path] = {}

    def _init_weights(self, module):  # the base arrives initialised; heads initialise themselves
        pass

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_base(cls, base_model: PreTrainedModel | str, num_heads: int = 4, head_type: str = "resblock",
                  dtype: torch.dtype | str = torch.float32, **config_kwargs) -> BlockwiseParallelForCausalLM:
        """Wrap `base_model` (a model, a local path, a Hub id or a packaged alias) with fresh heads.

        `config_kwargs` are `BlockwiseParallelConfig` fields (`num_layers_per_head`, `tie_head_projection`,
        `draft_vocab`, `head_loss_weights`, ...).
        """
        if isinstance(base_model, (str, os.PathLike)):
            name = str(base_model)
            base_model = load_base_model(name, dtype=dtype)
        else:
            check_causal_lm(base_model)
            name = base_model.config.name_or_path or base_model.name_or_path
        config = BlockwiseParallelConfig(num_heads=num_heads, head_type=head_type, base_model_name_or_path=name or None,
                                         base_model_fingerprint=fingerprint(base_model),
                                         text_config=copy.deepcopy(base_model.config), **config_kwargs)
        return cls(config, base_model)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        base_model: PreTrainedModel | str | None = None, config: BlockwiseParallelConfig | None = None,
                        dtype: torch.dtype | str | None = None, device_map=None, attn_implementation: str | None = None,
                        quantization_config=None, ignore_fingerprint_mismatch: bool = False,
                        trust_bundled_files: bool = False, **kwargs) -> BlockwiseParallelForCausalLM:
        """Load heads saved by `save_pretrained` (a local directory or a Hub repo id) onto their base model.

        The base is `base_model` when given (a model or a name for `load_base`), else the config's
        `base_model_name_or_path`. Its fingerprint must match the one the heads were saved with, unless
        `ignore_fingerprint_mismatch=True`. Bundled rescorers load on first use (`trust_bundled_files`:
        docs/reliability.md).

        `dtype` (default: the checkpoint's recorded one where hf_bpd's kernels run it, else float32:
        `default_base_dtype`; `"auto"`: the base's own), `device_map` (`"cuda"`, `"auto"`, ...),
        `attn_implementation` and `quantization_config` go to the base's `AutoModelForCausalLM.from_pretrained`, as
        in transformers (`Int8WeightsConfig()`: hf_bpd's int8 weights, after the fingerprint check). The heads sit
        on the device of the base's output layer, in its dtype (fp32 if not floating-point): see `heads_placement`.
        """
        dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype  # transformers' older name
        int8_weights, quantization_config = split_int8_weights(quantization_config)
        load_options = {k: v for k, v in (("device_map", device_map), ("attn_implementation", attn_implementation),
                                          ("quantization_config", quantization_config)) if v is not None}
        directory, downloaded = resolve_checkpoint_dir(pretrained_model_name_or_path, kwargs)
        config = check_heads_header(directory, config if config is not None else load_heads_config(directory))
        if base_model is None:
            if not config.base_model_name_or_path:
                raise BaseModelError("the checkpoint names no base model: pass base_model=... to from_pretrained")
            base_model = config.base_model_name_or_path
        base_name = str(base_model) if isinstance(base_model, (str, os.PathLike)) else None
        if base_name is not None:
            base_model = load_base_model(base_name, dtype=dtype or default_base_dtype(config), **load_options)
        elif load_options:
            raise BaseModelError(f"{', '.join(load_options)} apply when the base is loaded by name: pass them to the "
                                 "base's own from_pretrained, or pass base_model= as a name")
        elif dtype is not None:
            base_model = base_model.to(dtype=dtype)
        check_causal_lm(base_model)
        if quantization_config is None:
            check_fingerprint(base_model, config.base_model_fingerprint, directory, ignore_fingerprint_mismatch)
        else:  # quantized at load: its weights cannot match the fingerprint of the weights the heads were trained on
            logger.warning("the base was quantized at load, so its fingerprint is not checked: make sure "
                           f"{config.base_model_name_or_path!r} is the base the heads were trained on")
        if config.base_adapter:
            base_model = merge_base_adapter(base_model, inside(directory, config.base_adapter, "base_adapter"))
        if int8_weights is not None:  # an alias's int8 weights come from the cache, unless an adapter changed them
            saved = None if config.base_adapter else int8_weights_file(base_name, int8_weights)
            quantize_int8_weights(base_model, int8_weights, saved)
        model = cls(config, base_model)
        if config.base_adapter:
            model._bundle_sources["base_adapter"] = directory / config.base_adapter
        model.heads.load_state_dict(load_heads_state(directory, model.heads, config.draft_vocab), strict=True)
        config.draft_vocab = None  # from here on the ids live in the heads' state
        model.generation_config = load_generation_config(directory, base_model, config)
        load_bundled(model, directory, trusted=trust_bundled_files or not downloaded)
        model.eval()
        preload_artifact(model.base_lm, model.generation_config)  # a step `hf-bpd compile` built
        return model

    @property
    def feature_drafter(self):
        """The feature-level drafter `generate(drafter="feature")` drafts with (`hf_bpd.feature_drafter`), or None."""
        return self._feature_drafter[0] if self._feature_drafter else None

    def load_feature_drafter(self, folder: str | os.PathLike) -> None:
        """Attach the feature-level drafter `training/train_drafter.py` saved in `folder`; `save_pretrained` then
        stores it in the checkpoint's `feature_drafter/`."""
        self._feature_drafter = [load_feature_drafter(self.base_lm, Path(folder))]

    def bundle_rescorer(self, name: str, path: str | os.PathLike, alpha: float = 1.0, **fields) -> None:
        """Attach the rescorer `name` (registered: `hf_bpd.available_rescorers()`) stored at `path`, with its tuned
        `alpha` and fields (`order` for "ngram"; `type`, `num_layers` for "neural"): `generate(rescorer=name)` then
        uses it and `save_pretrained` copies its file(s) into `rescorers/`."""
        attach_rescorer(self, name, Path(path), {"alpha": alpha, **bundle_fields(name, Path(path), fields)})
        self.bundled_rescorers[name]  # the caller's own file: load now, so a bad one fails here

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs) -> None:
        """Write `config.json`, `generation_config.json`, `heads.safetensors` (weights and draft vocabulary), the
        bundled rescorers and a model card `README.md`.

        The base model's weights are never written: the config names the base and records its fingerprint.
        """
        if kwargs.pop("push_to_hub", False):
            raise ValueError("use model.push_to_hub(repo_id) to upload")
        if not is_main_process:
            return
        save_checkpoint(self, Path(save_directory))

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | bool | None = None,
                    commit_message: str = "Upload blockwise parallel decoding heads", revision: str | None = None,
                    create_pr: bool = False):
        """Upload what `save_pretrained` writes (config, heads, model card) to the Hub repo `repo_id`."""
        return push_saved(self.save_pretrained, repo_id, private=private, token=token, revision=revision,
                          commit_message=commit_message, create_pr=create_pr)

    # ------------------------------------------------------------------ parameters
    def freeze_base(self, frozen: bool = True) -> None:
        """Freeze (Medusa-1, the paper's setting) or unfreeze the base model's parameters."""
        for p in self.base_lm.parameters():
            p.requires_grad_(not frozen)

    def trainable_parameters(self) -> dict[str, int]:
        """`{"heads": n, "base": n, "total": n}`: trainable parameter counts (shared weights counted once)."""
        seen, counts = set(), {"heads": 0, "base": 0}
        for name, p in self.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                counts["heads" if name.startswith("heads.") else "base"] += p.numel()
        counts["total"] = counts["heads"] + counts["base"]
        return counts

    def get_input_embeddings(self):
        return self.base_lm.get_input_embeddings()

    def get_output_embeddings(self):  # the base's: the heads share it
        return self.base_lm.get_output_embeddings()

    def get_decoder(self):
        return self.base_lm.get_decoder()

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache=None,
                inputs_embeds: torch.FloatTensor | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, return_head_logits: bool = True, num_heads: int | None = None,
                base_loss_weight: float = 0.0, past_key_values=None, **kwargs) -> BlockwiseParallelOutput:
        """Run the base once and the heads on its last hidden state. Every base argument passes through;
        `labels` (aligned with `input_ids`, -100 ignored) train head `h` (1-based) at `t` on `labels[t + 1 + h]`;
        `num_heads` uses the first heads only; `base_loss_weight` adds the base's own loss (0 for a frozen base).
        The KV cache is `cache` or, as before transformers 5.24, `past_key_values`: either name, on any version."""
        if cache is not None and past_key_values is not None:
            raise BPDConfigError("pass the KV cache once: as cache= (or past_key_values=), not both")
        cache = past_key_values if cache is None else cache
        captured = {}
        caller = threading.get_ident()

        def keep_hidden(_module, args):
            if threading.get_ident() == caller:  # another thread's forward on this model is not ours
                captured["hidden"] = args[0]

        given = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     inputs_embeds=inputs_embeds, use_cache=use_cache, **{CACHE_NAME: cache})
        handle = self.base_lm.get_output_embeddings().register_forward_pre_hook(keep_hidden)
        try:
            base_out = self.base_lm(**{k: v for k, v in given.items() if v is not None}, **kwargs)
        finally:
            handle.remove()
        hidden = captured["hidden"]
        n = self.config.num_heads if num_heads is None else num_heads
        head_logits = self.heads(hidden, n, tokens=input_ids) if return_head_logits else None
        loss = base_loss = head_losses = None
        if labels is not None:
            head_loss, head_losses = self.heads.loss(hidden, labels, self.config.head_loss_weights, n)
            base_loss = next_token_loss(base_out.logits, labels)
            loss = head_loss + base_loss_weight * base_loss
        return BlockwiseParallelOutput(
            loss=loss, base_loss=base_loss, head_losses=head_losses, logits=base_out.logits,
            head_logits=head_logits, last_hidden_state=hidden,
            **{CACHE_NAME: base_out.get(CACHE_NAME)},
            hidden_states=getattr(base_out, "hidden_states", None), attentions=getattr(base_out, "attentions", None),
        )

    # ------------------------------------------------------------------ generation
    def prepare_inputs_for_generation(self, *args, **kwargs):
        inputs = self.base_lm.prepare_inputs_for_generation(*args, **kwargs)
        inputs.setdefault("return_head_logits", False)
        return inputs

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """The standard `generate()`, drafting with the heads; the output is the base model's own.

        Every `GenerationMixin.generate` argument works as in plain decoding, except what only transformers' own loop
        runs (`transformers_only`: an error with the heads; `use_heads=False` runs the base's `generate()` for it).
        Drafting options (`use_heads`, `rescorer`, `num_drafts`, `tree`, ...; `hf_bpd.BlockwiseGenerationConfig`) come
        from this call, else `generation_config`, else `model.generation_config`; its `GenerationStats` lands on
        `model.last_generation_stats` (and on the output's `generation_stats` for dict outputs).
        """
        start = time.perf_counter()
        options = drafting_options(kwargs, generation_config, self.generation_config)
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        check_inputs(self, prompt, generation_config, kwargs)  # one-line errors before any forward pass
        own_loop = transformers_only(call_option(kwargs, generation_config, self.generation_config))
        if not options.use_heads and (not options.compile or own_loop is not None):  # transformers' loop, uncompiled
            stats, result = GenerationStats(method="plain"), super().generate(inputs, generation_config, **kwargs)
        elif own_loop is not None:
            raise BPDConfigError(own_loop[1])
        else:
            plan = plan_call(self, options, kwargs)
            stop_strings_as_criteria(kwargs, generation_config, self.generation_config)
            decode = functools.partial(blockwise_decoding, plan=plan)
            result = super().generate(inputs, generation_config, custom_generate=decode, **kwargs)
            stats = plan.stats
        self.last_generation_stats = stats
        return finish_stats(stats, result, prompt, start)


# `AutoConfig` / `AutoModelForCausalLM.from_pretrained(dir)` know the model type once this module is imported.
AutoConfig.register(BlockwiseParallelConfig.model_type, BlockwiseParallelConfig, exist_ok=True)
AutoModelForCausalLM.register(BlockwiseParallelConfig, BlockwiseParallelForCausalLM, exist_ok=True)
