"""Blockwise parallel decoding (BPD) heads on a causal base model, for `trust_remote_code=True` loading.

Written into a heads checkpoint by `hf_bpd.hub.remote_code.write_remote_code`, next to `configuration_bpd.py` and
`heads_bpd.py` (a verbatim copy of `hf_bpd/heads.py`). It needs torch, transformers and safetensors only:

    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    model.generate(**inputs, max_new_tokens=64)  # greedy: drafts with the heads; the output is the base's own

The base model is loaded from the Hub id (or local path) the config records; only the heads are in the checkpoint.
Greedy decoding of one unpadded sequence drafts a block with the heads (the base's next token, then one token per
head), verifies it with one base forward pass and keeps the longest prefix the base agrees with plus the base's own
next token. Every other request (sampling, beams, batches, padding, streamers, ...) is the base's own `generate()`.
The full feature set (draft trees, rescorers, sampling with heads, compiled verification) is in `pip install hf_bpd`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMode
from transformers.utils import cached_file

from .configuration_bpd import BlockwiseParallelConfig
from .heads_bpd import CACHE_NAME, DraftHeads

HEADS_WEIGHTS_NAME = "heads.safetensors"
# `from_pretrained` keyword arguments that locate files of the heads checkpoint; the shared ones also reach the base.
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
_SHARED_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "token")
# Set by `AutoModelForCausalLM.from_pretrained` for itself, not meant for the base.
_AUTO_KWARGS = ("trust_remote_code", "adapter_kwargs", "code_revision", "_commit_hash", "_from_auto", "_from_pipeline")
# Model inputs `generate()` prepares for a plain text prompt; anything else (images, token types, ...) falls back.
_PLAIN_MODEL_KWARGS = {"attention_mask", "position_ids", CACHE_NAME, "use_cache", "logits_to_keep", "cache_position"}


def fingerprint(model: PreTrainedModel, samples_per_tensor: int = 64) -> str:
    """A short, dtype-independent fingerprint of a model's weights: the same function as `hf_bpd.fingerprint` (each
    parameter's name and shape plus evenly spaced values rounded to bfloat16), so the two agree on one model."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            n = flat.numel()
            k = min(samples_per_tensor, n)
            idx = torch.arange(k, device=flat.device) * (n - 1) // max(k - 1, 1)
            values = flat[idx].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
            digest.update(f"{name}:{tuple(param.shape)};".encode())
            digest.update(values)
    return "sha256:" + digest.hexdigest()[:32]


@dataclass
class GenerationStats:
    """What one `generate()` call did: `method` is `"bpd"` (drafted with the heads) or `"base"` (the base's own
    `generate()`, for the `reason` given)."""

    method: str
    reason: str | None = None
    new_tokens: int = 0
    forwards: int = 0  # serial base forward passes, the prompt pass included ("bpd" only)
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per verification

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_lengths)

    @property
    def block_efficiency(self) -> float | None:
        """Tokens decoded per serial base call (the paper's block efficiency)."""
        return self.new_tokens / self.forwards if self.forwards else None


class _Unsupported(Exception):
    """Raised by the drafting loop before any forward pass when the prepared request is not greedy decoding of one
    unpadded sequence; `generate()` then runs the base's own `generate()`."""


class BlockwiseParallelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal base model (`base_lm`) with `config.num_heads` drafting heads (`heads`)."""

    config_class = BlockwiseParallelConfig
    base_model_prefix = "base_lm"
    main_input_name = "input_ids"
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: BlockwiseParallelConfig, base_model: PreTrainedModel | None = None):
        super().__init__(config)
        if base_model is None:  # a randomly initialised base of the configured architecture
            base_model = AutoModelForCausalLM.from_config(config.text_config)
        for name in ("hidden_size", "vocab_size"):
            want, have = getattr(config, name), getattr(base_model.config.get_text_config(), name, None)
            if want != have:
                raise ValueError(f"the heads' config has {name}={want} but the base model has {have}: load the base "
                                 "model the heads were built for")
        self.base_lm = base_model
        self.heads = DraftHeads(config, base_model.get_output_embeddings(), base_model.get_input_embeddings())
        # The heads read the input of the base's output layer and share its weights: put them where that layer is,
        # in its dtype (fp32 when it holds no floating-point weights, e.g. quantized), as hf_bpd does.
        weight = base_model.get_output_embeddings().weight
        self.heads.to(device=weight.device, dtype=weight.dtype if weight.is_floating_point() else torch.float32)
        self.generation_config = base_model.generation_config
        self.num_heads_to_use = config.num_heads
        self.last_generation_stats: GenerationStats | None = None

    def _init_weights(self, module):  # the base arrives initialised; heads initialise themselves
        pass

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        base_model: PreTrainedModel | str | None = None, config: BlockwiseParallelConfig | None = None,
                        dtype: torch.dtype | str | None = None, device_map=None, attn_implementation: str | None = None,
                        quantization_config=None, **kwargs) -> BlockwiseParallelForCausalLM:
        """Load the base model, then the heads in `pretrained_model_name_or_path` (a directory or a Hub repo id).

        The base is `base_model` (a model, a local path or a Hub id), else the config's `base_model_hub_id` (else
        `base_model_name_or_path`), loaded with `AutoModelForCausalLM.from_pretrained(..., dtype=, device_map=,
        attn_implementation=, quantization_config=)` and the remaining keyword arguments. The heads follow the
        base's output layer's device and the base's dtype.
        """
        dtype = dtype if dtype is not None else kwargs.pop("torch_dtype", None)
        for name in _AUTO_KWARGS:
            kwargs.pop(name, None)
        hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
        if config is None:
            config = BlockwiseParallelConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        # AutoModelForCausalLM.from_pretrained hands attn_implementation to the config, not to this method.
        attn_implementation = attn_implementation or config._attn_implementation
        if base_model is None or isinstance(base_model, (str, os.PathLike)):
            name = base_model if base_model is not None else (config.base_model_hub_id
                                                              or config.base_model_name_or_path)
            if not name:
                raise ValueError("the checkpoint names no base model: pass base_model=... to from_pretrained")
            options = dict(dtype=dtype, device_map=device_map, attn_implementation=attn_implementation,
                           quantization_config=quantization_config)
            options = {k: v for k, v in options.items() if v is not None}
            options.update({k: hub[k] for k in _SHARED_HUB_KWARGS if k in hub}, **kwargs)
            try:
                base_model = AutoModelForCausalLM.from_pretrained(str(name), **options)
            except OSError as err:
                raise OSError(f"could not load the base model {str(name)!r} that the heads in "
                              f"{pretrained_model_name_or_path} were trained on ({str(err).splitlines()[0]}): pass "
                              "base_model= (a local copy or another Hub id of it)") from err
        elif dtype is not None:
            base_model = base_model.to(dtype=dtype)

        expected, actual = config.base_model_fingerprint, fingerprint(base_model)
        if expected and actual != expected:
            # hf_bpd refuses such a base; here it only costs speed (fewer drafts accepted), never correctness. A
            # packaged base (hf_bpd dequantises a GGUF) differs from its Hub original this way.
            warnings.warn(f"the heads in {pretrained_model_name_or_path} were trained on other weights of the base "
                          f"model (fingerprint {expected}, this one has {actual}): the output is still the base's "
                          "own, but drafts may be accepted less often", stacklevel=2)
        if config.base_adapter:
            base_model = _merge_base_adapter(base_model, pretrained_model_name_or_path, config.base_adapter, hub)

        model = cls(config, base_model)
        state = load_file(cached_file(pretrained_model_name_or_path, HEADS_WEIGHTS_NAME, **hub))
        if "draft_vocab" not in state and config.draft_vocab is not None:  # checkpoints of hf_bpd < the move
            state["draft_vocab"] = torch.tensor(config.draft_vocab, dtype=torch.long)
        model.heads.load_state_dict(state, strict=True)
        config.draft_vocab = None  # from here on the ids live in the heads' state
        model.num_heads_to_use = _tuned_num_heads(pretrained_model_name_or_path, hub, config.num_heads)
        return model.eval()

    def get_input_embeddings(self):
        return self.base_lm.get_input_embeddings()

    def get_output_embeddings(self):
        return self.base_lm.get_output_embeddings()

    def get_decoder(self):
        return self.base_lm.get_decoder()

    def forward(self, *args, **kwargs):
        """The base model's forward pass (`model(**inputs).logits` are the base's logits)."""
        return self.base_lm(*args, **kwargs)

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """The base model's `generate()`; greedy decoding of one unpadded sequence drafts with the heads.

        Extra options: `use_heads` (default True) and `num_heads_to_use` (default: the checkpoint's tuned value, else
        every head). Returns what the base's `generate()` returns: a `(1, prompt + new tokens)` tensor, or a
        `GenerateDecoderOnlyOutput` (sequences, scores, logits, cache) with `return_dict_in_generate=True`.
        What the call did lands on `model.last_generation_stats` (`GenerationStats`).
        """
        drafter = kwargs.pop("drafter", "heads")
        if drafter != "heads":
            raise ValueError(f"drafter={drafter!r}: this remote code drafts with the heads only; install hf_bpd and "
                             "load with hf_bpd.BlockwiseParallelForCausalLM.from_pretrained for the feature-level "
                             "drafter")
        use_heads = kwargs.pop("use_heads", True)
        num_heads = kwargs.pop("num_heads_to_use", None) or self.num_heads_to_use
        reason = _unsupported_arguments(inputs, kwargs) if use_heads else "use_heads=False"
        stats = GenerationStats(method="bpd")
        result = None
        if reason is None:
            decode = functools.partial(_blockwise_greedy, heads=self.heads, stats=stats,
                                       num_heads=min(num_heads, len(self.heads.heads)))
            try:
                # transformers prepares the generation config, logits processors, stopping criteria and the cache
                # exactly as for its own decoding, then hands them to the drafting loop.
                result = self.base_lm.generate(inputs, generation_config, custom_generate=decode, **kwargs)
            except _Unsupported as err:  # raised before any forward pass
                reason = str(err)
        if reason is not None:
            stats = GenerationStats(method="base", reason=reason)
            result = self.base_lm.generate(inputs, generation_config, **kwargs)
            sequences = result if isinstance(result, torch.Tensor) else result.sequences
            prompt = inputs if inputs is not None else kwargs.get("input_ids")
            prompt_length = prompt.shape[-1] if isinstance(prompt, torch.Tensor) else 0
            stats.new_tokens = sequences.shape[-1] - prompt_length
        self.last_generation_stats = stats
        return result


def _unsupported_arguments(inputs, kwargs: dict) -> str | None:
    """Why the call's own arguments rule drafting out (None: try drafting; the prepared request is checked later)."""
    prompt = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.shape[0] != 1:
        return "drafting decodes one sequence of input_ids at a time"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    for name in ("streamer", "assistant_model", "custom_generate", "negative_prompt_ids", "tokenizer",
                 "synced_gpus"):
        if kwargs.get(name):
            return f"{name} is handled by the base's generate()"
    return None


def _tuned_num_heads(checkpoint, hub: dict, default: int) -> int:
    """The `num_heads_to_use` hf_bpd tuned and saved in the checkpoint's generation_config.json, else `default`."""
    try:
        with open(cached_file(checkpoint, "generation_config.json", **hub), encoding="utf-8") as f:
            value = json.load(f).get("num_heads_to_use")
    except (OSError, ValueError):
        return default
    return value if isinstance(value, int) and 1 <= value <= default else default


def _merge_base_adapter(base_model, checkpoint, adapter: str, hub: dict):
    """Merge the checkpoint's LoRA adapter for the base (hf_bpd's Medusa-2 training) into the base: without it the
    output would be the un-adapted base's, not what hf_bpd decodes."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ImportError(f"this checkpoint fine-tuned its base with a LoRA adapter ({adapter}): pip install peft "
                          "to load it") from None
    hub = {k: v for k, v in hub.items() if k in ("cache_dir", "token", "revision", "local_files_only")}
    return PeftModel.from_pretrained(base_model, str(checkpoint), subfolder=adapter, **hub).merge_and_unload()


@torch.no_grad()
def _blockwise_greedy(model, input_ids, logits_processor, stopping_criteria, generation_config, *, heads, num_heads,
                      stats: GenerationStats, **model_kwargs):
    """The `custom_generate` decoding loop (`model` is the base): draft a block, verify it in one forward pass, keep
    the longest prefix the base agrees with plus the base's own next token, crop the cache back to it.

    Each token is the argmax of the base's processed logits after exactly the tokens before it, as in transformers'
    greedy decoding, and the stopping criteria are checked after every token, so the output is the base's own.
    """
    cache = model_kwargs.get(CACHE_NAME)
    mask = model_kwargs.get("attention_mask")
    problem = (
        f"{generation_config.get_generation_mode().value} decoding is the base's generate()" if
        generation_config.get_generation_mode() != GenerationMode.GREEDY_SEARCH
        else "drafting decodes one sequence at a time" if input_ids.shape[0] != 1
        else "padding" if mask is not None and not bool(mask.all())
        else "drafting needs an empty DynamicCache" if not isinstance(cache, DynamicCache) or cache.get_seq_length()
        else "use_cache=False" if not generation_config.use_cache
        else "output_attentions / output_hidden_states" if (generation_config.output_attentions
                                                             or generation_config.output_hidden_states)
        else f"model inputs {sorted(set(model_kwargs) - _PLAIN_MODEL_KWARGS)}"
        if set(model_kwargs) - _PLAIN_MODEL_KWARGS else None
    )
    if problem is not None:
        raise _Unsupported(problem)
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers keep what a rollback needs
        cache.activate_past_recording()
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores, raw_logits = [], []
    sequence = input_ids

    def accept(logits: torch.Tensor) -> tuple[int, bool]:
        """Append the base's greedy choice from `logits` `(1, vocab)`; `(token, a stopping criterion holds)`."""
        nonlocal sequence
        logits = logits.to(device=sequence.device, dtype=torch.float32)  # as transformers' greedy loop does
        processed = logits_processor(sequence, logits.clone())
        token = processed.argmax(-1)
        sequence = torch.cat([sequence, token[:, None].to(sequence)], dim=1)
        if keep_scores:
            scores.append(processed)
        if keep_logits:
            raw_logits.append(logits)
        stop = stopping_criteria(sequence, tuple(scores) if keep_scores else None)
        return int(token), bool(stop.all())

    # The heads read the input of the base's output layer (its last hidden state), in their own dtype.
    dtype = next(heads.parameters()).dtype
    captured = {}
    handle = model.get_output_embeddings().register_forward_pre_hook(
        lambda _module, args: captured.__setitem__("hidden", args[0]))
    try:
        extra = {"logits_to_keep": 1} if "logits_to_keep" in model_kwargs else {}
        out = model(input_ids=input_ids, use_cache=True, **{CACHE_NAME: cache}, **extra)
        stats.forwards += 1
        token, done = accept(out.logits[:, -1])
        hidden = captured["hidden"][0, -1].to(dtype)
        while not done:
            # Head i drafts token i + 1 after the base's own next token (the last token, not yet in the cache).
            k = max(0, min(num_heads, generation_config.max_length - sequence.shape[1] - 1))
            block = sequence[:, -1:]
            if k:
                draft = heads.step_logits(hidden, k, next_token=token).argmax(-1)
                block = torch.cat([block, heads.to_vocab_ids(draft)[None].to(block)], dim=1)
            out = model(input_ids=block, use_cache=True, **{CACHE_NAME: cache})
            stats.forwards += 1
            block_logits, block_hidden = out.logits[0], captured["hidden"][0]
            for j in range(k + 1):
                token, done = accept(block_logits[j][None])
                hit = j < k and token == int(block[0, j + 1])  # the base's choice is the next drafted token
                if done or not hit:
                    break
            stats.accepted_lengths.append(j + hit)
            cache.crop(-(k - j))  # keep the last token and the j accepted drafts
            hidden = block_hidden[j].to(dtype)
    finally:
        handle.remove()
    stats.new_tokens = sequence.shape[1] - input_ids.shape[1]
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequence, scores=tuple(scores) if keep_scores else None,
                                         logits=tuple(raw_logits) if keep_logits else None, **{CACHE_NAME: cache})
    return sequence
