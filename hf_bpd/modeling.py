"""`BlockwiseParallelForCausalLM`: any causal LM plus drafting heads, saved and loaded on its own."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput, logging

from .base_models import check_causal_lm, fingerprint, load_base_model
from .configuration import BlockwiseParallelConfig
from .drafting import BlockDrafter, GenerationStats
from .errors import BaseModelError, BPDConfigError, CheckpointError
from .heads import DraftHeads
from .rescoring import HeadScoreRescorer, resolve_rescorer
from .tree import validate_tree_choices
from .verification import DecodingPlan, chain_decoding, tree_decoding

logger = logging.get_logger(__name__)

HEADS_WEIGHTS_NAME = "heads.safetensors"


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


def _masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over targets != -100; 0 (still differentiable) when every target is masked."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    total = nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum().clamp(min=1)


class BlockwiseParallelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal base model (`base_lm`) with `config.num_heads` drafting heads (`heads`).

    Build fresh heads with `from_base(...)`; load saved heads with `from_pretrained(dir)`. `save_pretrained` writes
    only the config and the heads: the base is named (and fingerprinted) in the config, never copied.
    """

    config_class = BlockwiseParallelConfig
    base_model_prefix = "base_lm"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

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
        self.heads = DraftHeads(config, base_model.get_output_embeddings())
        self.heads.to(device=base_model.device, dtype=base_model.dtype)
        self.generation_config = base_model.generation_config
        self.last_generation_stats: GenerationStats | None = None
        self._bpd_candidate_generator = None
        self.bundled_rescorers: dict = {}
        self._bundle_sources: dict[str, Path] = {}

    def _init_weights(self, module):
        # The base arrives initialised (or pretrained) and heads initialise themselves in their constructors.
        pass

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_base(
        cls,
        base_model: PreTrainedModel | str,
        num_heads: int = 4,
        head_type: str = "resblock",
        dtype: torch.dtype | str = torch.float32,
        **config_kwargs,
    ) -> "BlockwiseParallelForCausalLM":
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
        config = BlockwiseParallelConfig(
            num_heads=num_heads,
            head_type=head_type,
            base_model_name_or_path=name or None,
            base_model_fingerprint=fingerprint(base_model),
            text_config=copy.deepcopy(base_model.config),
            **config_kwargs,
        )
        return cls(config, base_model)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args,
        base_model: PreTrainedModel | str | None = None,
        config: BlockwiseParallelConfig | None = None,
        dtype: torch.dtype | str | None = None,
        ignore_fingerprint_mismatch: bool = False,
        **kwargs,
    ) -> "BlockwiseParallelForCausalLM":
        """Load heads saved by `save_pretrained` (a local directory or a Hub repo id) onto their base model.

        The base is `base_model` when given (a model or a name for `load_base`), else the config's
        `base_model_name_or_path`. Its fingerprint must match the one the heads were saved with, unless
        `ignore_fingerprint_mismatch=True`.
        """
        directory = _resolve_checkpoint_dir(pretrained_model_name_or_path, kwargs)
        if config is None:
            if not (directory / "config.json").exists():
                raise CheckpointError(f"no config.json in {directory}: pass a directory written by "
                                      "BlockwiseParallelForCausalLM.save_pretrained")
            config = BlockwiseParallelConfig.from_pretrained(directory)
        if base_model is None:
            if not config.base_model_name_or_path:
                raise BaseModelError("the checkpoint names no base model: pass base_model=... to from_pretrained")
            base_model = config.base_model_name_or_path
        if isinstance(base_model, (str, os.PathLike)):
            base_model = load_base_model(str(base_model), dtype=dtype or torch.float32)
        elif dtype is not None:
            base_model = base_model.to(dtype=dtype)
        check_causal_lm(base_model)

        actual = fingerprint(base_model)
        if config.base_model_fingerprint and actual != config.base_model_fingerprint:
            message = (
                f"the heads in {directory} were trained on another base model (fingerprint "
                f"{config.base_model_fingerprint}, this base has {actual}): load the base they were saved with "
                "or pass ignore_fingerprint_mismatch=True to use them anyway"
            )
            if not ignore_fingerprint_mismatch:
                raise BaseModelError(message)
            logger.warning(message)

        if config.base_adapter:
            from peft import PeftModel

            base_model = PeftModel.from_pretrained(base_model, directory / config.base_adapter).merge_and_unload()
        model = cls(config, base_model)
        if config.base_adapter:
            model._bundle_sources["base_adapter"] = directory / config.base_adapter
        model.heads.load_state_dict(_load_heads_file(directory, model.heads), strict=True)
        for name, spec in config.rescorers.items():
            model.bundle_rescorer(name, directory / spec["path"], **{k: v for k, v in spec.items() if k != "path"})
        model.eval()
        return model

    def bundle_rescorer(self, name: str, path: str | os.PathLike, alpha: float = 1.0, **fields) -> None:
        """Attach a rescorer to this checkpoint: `rescorer=name` in `generate()` then uses it, and `save_pretrained`
        copies its file(s) into `rescorers/`.

        Args:
            name: `"ngram"` (a KenLM binary over token ids; `order=`) or `"neural"` (a directory: a causal LM with the
                base vocabulary, or with `type="base_prefix", num_layers=n` a LoRA adapter over the base's first
                `n` layers).
            alpha: the interpolation weight (tuned per task, see `hf_bpd.tuning`).
        """
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"bundled {name} rescorer {path} is missing: rebuild it or remove it from "
                                  "config.json's 'rescorers'")
        spec = {"alpha": float(alpha), **fields}
        if name == "ngram":
            from .ngram import NgramRescorer

            rescorer = NgramRescorer(str(path), alpha=spec["alpha"], order=spec.get("order"))
        elif name == "neural":
            from .neural import load_bundled_neural

            rescorer = load_bundled_neural(self.base_lm, path.parent, {**spec, "path": path.name})
        else:
            raise BPDConfigError(f"unknown rescorer {name!r}: bundle 'ngram' or 'neural'")
        self.bundled_rescorers[name] = rescorer
        self._bundle_sources[name] = path
        self.config.rescorers[name] = {"path": f"rescorers/{path.name}", **spec}

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs) -> None:
        """Write `config.json`, `generation_config.json`, `heads.safetensors` and a model card `README.md`.

        The base model's weights are never written: the config names the base and records its fingerprint.
        """
        if kwargs.pop("push_to_hub", False):
            raise ValueError("use model.push_to_hub(repo_id) to upload")
        if not is_main_process:
            return
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(directory)
        self.generation_config.save_pretrained(directory)
        state = {k: v.detach().contiguous().cpu() for k, v in self.heads.state_dict().items()}

        save_file(state, directory / HEADS_WEIGHTS_NAME, metadata={"format": "pt", "library": "hf_bpd"})
        for name, source in self._bundle_sources.items():
            relative = self.config.base_adapter if name == "base_adapter" else self.config.rescorers[name]["path"]
            target = directory / relative
            if source.resolve() != target.resolve():
                target.parent.mkdir(exist_ok=True)
                if source.is_dir():
                    shutil.copytree(source, target, dirs_exist_ok=True)
                else:
                    shutil.copy2(source, target)
        from .model_card import write_model_card

        write_model_card(self, directory)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str = "Upload blockwise parallel decoding heads",
        revision: str | None = None,
        create_pr: bool = False,
    ):
        """Upload what `save_pretrained` writes (config, heads, model card) to the Hub repo `repo_id`."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=tmp,
                commit_message=commit_message,
                revision=revision,
                create_pr=create_pr,
            )

    # ------------------------------------------------------------------ parameters
    def freeze_base(self, frozen: bool = True) -> None:
        """Freeze (Medusa-1, the paper's setting) or unfreeze the base model's parameters."""
        for p in self.base_lm.parameters():
            p.requires_grad_(not frozen)

    def head_parameters(self):
        """Parameters that belong to the heads only (never the shared output embedding)."""
        return self.heads.parameters()

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

    def get_output_embeddings(self):
        return self.base_lm.get_output_embeddings()

    def get_decoder(self):
        return self.base_lm.get_decoder()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        return_head_logits: bool = True,
        num_heads: int | None = None,
        base_loss_weight: float = 0.0,
        **kwargs,
    ) -> BlockwiseParallelOutput:
        """Run the base once and the heads on its last hidden state.

        Args:
            input_ids: `(batch, seq)`; `attention_mask`, `position_ids`, `past_key_values`, `inputs_embeds`,
                `use_cache` and any other base argument (`logits_to_keep`, `cache_position`, ...) pass through.
            labels: `(batch, seq)` targets aligned with `input_ids` (as for any HF causal LM; -100 is ignored).
                Head `h` (1-based) at position `t` is trained on `labels[t + 1 + h]`.
            return_head_logits: also return `head_logits` (skip to save memory in training).
            num_heads: use only the first `num_heads` heads.
            base_loss_weight: weight of the base's next-token loss in `loss` (0 for a frozen base).
        """
        captured = {}

        def keep_hidden(_module, args):
            captured["hidden"] = args[0]

        hook = self.base_lm.get_output_embeddings().register_forward_pre_hook(keep_hidden)
        try:
            given = dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
            )
            base_out = self.base_lm(**{k: v for k, v in given.items() if v is not None}, **kwargs)
        finally:
            hook.remove()
        hidden = captured["hidden"]
        n = self.config.num_heads if num_heads is None else num_heads

        head_logits = [] if return_head_logits else None
        head_losses = []
        for i in range(n):
            logits_i = self.heads.head_logits(i, hidden) if (return_head_logits or labels is not None) else None
            if return_head_logits:
                head_logits.append(logits_i)
            if labels is not None:
                shift = i + 2  # head i (0-based) at position t predicts token t + 2 + i
                targets = self.heads.to_draft_ids(labels[:, shift:])
                head_losses.append(_masked_cross_entropy(logits_i[:, : max(hidden.shape[1] - shift, 0)], targets))

        loss = base_loss = None
        if labels is not None:
            base_loss = _masked_cross_entropy(base_out.logits[:, :-1], labels[:, 1:])
            weights = torch.tensor(self.config.head_loss_weights[:n], device=hidden.device)
            head_losses = torch.stack(head_losses)
            loss = (weights * head_losses).sum() + base_loss_weight * base_loss
        return BlockwiseParallelOutput(
            loss=loss,
            base_loss=base_loss,
            head_losses=head_losses if labels is not None else None,
            logits=base_out.logits,
            head_logits=torch.stack(head_logits, dim=1) if return_head_logits else None,
            last_hidden_state=hidden,
            past_key_values=getattr(base_out, "past_key_values", None),
            hidden_states=getattr(base_out, "hidden_states", None),
            attentions=getattr(base_out, "attentions", None),
        )

    # ------------------------------------------------------------------ generation
    def prepare_inputs_for_generation(self, *args, **kwargs):
        inputs = self.base_lm.prepare_inputs_for_generation(*args, **kwargs)
        inputs.setdefault("return_head_logits", False)
        return inputs

    def _get_candidate_generator(self, *args, **kwargs):
        # transformers' assisted loop asks for its drafter here; during BPD generation it gets the heads' drafter.
        if self._bpd_candidate_generator is not None:
            return self._bpd_candidate_generator
        return super()._get_candidate_generator(*args, **kwargs)

    def decoding_plan(
        self,
        rescorer=None,
        draft_top_k: int | None = None,
        num_drafts: int | None = None,
        num_heads_to_use: int | None = None,
        tree=None,
    ) -> DecodingPlan:
        """Validate the drafting arguments of `generate()` and build the drafter (see `generate`)."""
        config = self.config
        n = config.num_heads if num_heads_to_use is None else num_heads_to_use
        if not isinstance(n, int) or not 1 <= n <= config.num_heads:
            raise BPDConfigError(f"num_heads_to_use must be an integer in [1, {config.num_heads}], got {n!r}")
        num_drafts = config.num_drafts if num_drafts is None else num_drafts
        if not isinstance(num_drafts, int) or num_drafts < 1:
            raise BPDConfigError(f"num_drafts must be an integer >= 1, got {num_drafts!r}")
        rescorer = resolve_rescorer(config.rescorer if rescorer is None else rescorer, self)
        plain = num_drafts == 1 and isinstance(rescorer, HeadScoreRescorer) and tree is None
        top_k = draft_top_k if draft_top_k is not None else config.draft_top_k
        if top_k is None:
            top_k = 1 if plain else min(16, config.draft_vocab_size)
        if not isinstance(top_k, int) or not 1 <= top_k <= config.draft_vocab_size:
            raise BPDConfigError(f"draft_top_k must be an integer in [1, {config.draft_vocab_size}] (the draft "
                                 f"vocabulary), got {top_k!r}")
        choices = None
        if tree is not None:
            choices = validate_tree_choices(tree, n)
            widest = 1 + max(r for c in choices for r in c)
            if widest > config.draft_vocab_size:
                raise BPDConfigError(f"tree ranks reach {widest - 1}, beyond the {config.draft_vocab_size}-token draft "
                                     "vocabulary: use smaller ranks")
        rescorer.check_compatible(self)
        rescorer.reset()
        drafter = BlockDrafter(self.heads, n, top_k, num_drafts, rescorer, choices)
        use_tree = choices is not None or num_drafts > 1
        method = "tree" if choices is not None else ("p-best" if num_drafts > 1 else "chain")
        return DecodingPlan(drafter=drafter, stats=GenerationStats(method=method), use_tree=use_tree)

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        *,
        use_heads: bool = True,
        rescorer=None,
        draft_top_k: int | None = None,
        num_drafts: int | None = None,
        num_heads_to_use: int | None = None,
        tree=None,
        **kwargs,
    ):
        """The standard `generate()`, drafting with the heads; the output is the base model's own.

        Every `GenerationMixin.generate` argument works (`max_new_tokens`, `do_sample`, `temperature`, `top_p`,
        `top_k`, logits processors, stopping criteria, `streamer`, `eos_token_id`, `return_dict_in_generate`, ...).

        Args:
            use_heads: `False` decodes plainly with the base model.
            rescorer: `None` (head scores), `"ngram"` / `"neural"` (a rescorer bundled with the checkpoint) or a
                `hf_bpd.Rescorer`; it picks the draft(s) from each step's top-k lattice.
            draft_top_k: lattice width k (default 1 for plain BPD, 16 when rescoring or verifying several drafts).
            num_drafts: drafts verified together per step (p-best drafts; > 1 uses tree verification).
            num_heads_to_use: draft with only the first heads (block size = num_heads_to_use + 1).
            tree: Medusa-style tree of top-k rank paths, e.g. `hf_bpd.sparse_tree((4, 2, 2, 1))` or
                `[(0,), (1,), (0, 0)]`; verified in one pass with tree attention.

        After the call `model.last_generation_stats` holds a `GenerationStats` (new tokens, serial calls, block
        efficiency, accepted lengths, drafting vs verification time).
        """
        start = time.perf_counter()
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if not use_heads:
            result = super().generate(inputs, generation_config, **kwargs)
            stats = GenerationStats(method="plain")
        else:
            plan = self.decoding_plan(rescorer, draft_top_k, num_drafts, num_heads_to_use, tree)
            plan.streamer = kwargs.pop("streamer", None)
            decode = functools.partial(tree_decoding if plan.use_tree else chain_decoding, plan=plan)
            result = super().generate(inputs, generation_config, custom_generate=decode, **kwargs)
            stats = plan.stats
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        prompt_length = prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 else 0
        stats.new_tokens = sequences.shape[1] - prompt_length
        if not use_heads:
            stats.accepted_lengths = [0] * stats.new_tokens
        stats.total_seconds = time.perf_counter() - start
        self.last_generation_stats = stats
        return result


def _resolve_checkpoint_dir(name_or_path: str | os.PathLike, hub_kwargs: dict) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if str(name_or_path).startswith((".", "/")) or path.exists():
        raise CheckpointError(f"{name_or_path} is not a directory: pass the directory save_pretrained wrote")
    from huggingface_hub import snapshot_download

    allowed = {k: hub_kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in hub_kwargs}
    try:
        return Path(snapshot_download(str(name_or_path), **allowed))
    except Exception as err:  # noqa: BLE001 - any Hub failure becomes one actionable line
        raise CheckpointError(
            f"could not find heads {name_or_path!r} locally or on the Hub ({type(err).__name__}): pass a local "
            "directory written by save_pretrained"
        ) from None


def _load_heads_file(directory: Path, heads: DraftHeads) -> dict[str, torch.Tensor]:
    path = directory / HEADS_WEIGHTS_NAME
    if not path.exists():
        raise CheckpointError(f"no {HEADS_WEIGHTS_NAME} in {directory}: save the heads with "
                              "model.save_pretrained(dir) (only safetensors are read)")
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupt or not a safetensors file ({str(err).splitlines()[0]}): "
                              "save the heads again with model.save_pretrained(dir)") from None
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"shape of {wrong[0]} is {tuple(state[wrong[0]].shape)}, config says "
                  f"{tuple(expected[wrong[0]].shape)}")
        raise CheckpointError(f"{path} disagrees with its config.json ({detail}): the config and weights were not "
                              "saved together; save them again with model.save_pretrained(dir)")
    return {k: v.to(dtype=expected[k].dtype, device=expected[k].device) for k, v in state.items()}
