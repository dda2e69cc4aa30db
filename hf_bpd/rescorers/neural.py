"""Local neural rescoring (paper Alg. 2): a small causal LM that shares the base vocabulary rescores each head's top-k
greedily, left to right: row `i` picks `argmax_{s in S_i} head_logprob[i, s] + alpha * r_i[s]`, where `r_i` are the
rescorer's logits given the context and the draft tokens already chosen. Interpolating log-probabilities or logits is
the same choice (they differ by a constant per row). The base's own next token (the context's last token) is never
rescored: it is not in the lattice.

The rescorer keeps a KV cache across steps: each call crops it to the longest common prefix with the new context and
feeds only the new tokens, then one token per draft position. Only its backbone runs; the k lattice rows of its
output embedding are multiplied with the last hidden state (never the whole vocabulary).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..errors import BPDConfigError, CheckpointError
from ..kv_cache import CACHE_NAME
from ..lattice import Draft, Lattice
from .base import Rescorer, register_rescorer


@register_rescorer("neural")
class NeuralRescorer(Rescorer):
    """Greedy local rescoring with a small causal LM.

    Args:
        model_or_path: a causal LM (`PreTrainedModel`) or a directory/Hub id for `AutoModelForCausalLM`.
        alpha: interpolation weight α >= 0 (α = 0 reproduces the heads' own top-1 draft).
    """

    def __init__(self, model_or_path: PreTrainedModel | str, alpha: float = 1.0):
        if alpha is None or alpha < 0:
            raise BPDConfigError(f"alpha must be >= 0, got {alpha}")
        if isinstance(model_or_path, PreTrainedModel):
            self.model = model_or_path
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=torch.float32)
        self.model.eval()
        self.alpha = float(alpha)
        # The backbone (everything before the output layer): each step needs only the k lattice rows of the output
        # layer, so the full-vocabulary projection is never run.
        self.backbone = self.model.base_model
        softcap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        self.softcap = float(softcap) if softcap else None
        self.reset()

    @classmethod
    def from_bundle(cls, base_model, path, alpha: float = 1.0, type: str = "model", num_layers: int | None = None,
                    **fields) -> "NeuralRescorer":
        """A bundled neural rescorer: `type="base_prefix"` is a LoRA adapter directory over the base's first
        `num_layers` layers; `type="model"` is any causal LM directory with the base vocabulary."""
        if type in ("base_prefix", "model") and not any(Path(path).glob("*.safetensors")):
            raise CheckpointError(f"the neural rescorer in {path} holds no safetensors weights (only safetensors are "
                                  "read): save it again with save_pretrained")
        if type == "base_prefix":
            from peft import PeftModel

            if not isinstance(num_layers, int) or isinstance(num_layers, bool):
                raise BPDConfigError("a base_prefix neural rescorer needs num_layers (the base layers it reuses)")
            try:
                with quiet_peft():
                    lm = PeftModel.from_pretrained(truncated_base(base_model, num_layers), path).merge_and_unload()
            except BPDConfigError:
                raise
            except Exception as err:  # noqa: BLE001 - peft / safetensors raise many kinds, with long messages
                raise CheckpointError(f"the neural rescorer in {path} cannot be loaded ({type(err).__name__}: "
                                     f"{_first_line(err)}): restore it or retrain it (training/train_rescorer.py)"
                                     ) from None
        elif type == "model":
            try:
                lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
            except Exception as err:  # noqa: BLE001
                raise CheckpointError(f"the neural rescorer in {path} cannot be loaded ({type(err).__name__}: "
                                     f"{_first_line(err)}): restore it or retrain it") from None
        else:
            raise BPDConfigError(f"unknown neural rescorer type {type!r}: use 'base_prefix' or 'model'")
        return cls(lm, alpha=alpha)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def check_compatible(self, model) -> None:
        base_vocab = model.config.get_text_config().vocab_size
        if self.vocab_size != base_vocab:
            raise BPDConfigError(f"the neural rescorer's vocabulary ({self.vocab_size} tokens) differs from the base "
                                 f"model's ({base_vocab}): use a rescorer trained with the base tokenizer")

    def for_call(self) -> "NeuralRescorer":
        """A copy sharing this rescorer's LM with its own KV cache: each `generate()` call rescores with its own
        state, so concurrent calls on one model cannot corrupt each other's cache."""
        fresh = object.__new__(type(self))
        fresh.__dict__.update(self.__dict__)
        fresh.reset()
        return fresh

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        self.cache.activate_past_recording()  # sliding-window layers must be able to roll back
        self.cached: list[int] = []

    @torch.no_grad()
    def _advance(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` after the cached ones; return the hidden state at the last position `(hidden,)`."""
        ids = torch.tensor([tokens], device=self.model.device)
        out = self.backbone(input_ids=ids, **{CACHE_NAME: self.cache}, use_cache=True)
        self.cached.extend(tokens)
        return out.last_hidden_state[0, -1]

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Make the cache hold exactly `context`, reusing the longest common prefix; return the hidden state after
        its last token (at least one token is always fed, to get that state)."""
        keep = 0
        limit = min(len(self.cached), len(context) - 1)
        while keep < limit and self.cached[keep] == context[keep]:
            keep += 1
        if keep == 0:
            self.reset()
        else:
            self.cache.crop(-(len(self.cached) - keep))
            self.cached = self.cached[:keep]
        return self._advance(context[keep:])

    def _scores(self, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Rescorer logits of `candidates` `(k,)` given `hidden`; only those k output rows are used."""
        head = self.model.get_output_embeddings()
        weight = head.weight.index_select(0, candidates.to(head.weight.device))
        logits = weight @ hidden.to(weight.dtype)
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias[candidates]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float().cpu()

    @torch.no_grad()
    def rescore(self, lattice: Lattice, context: list[int], num_drafts: int) -> list[Draft]:
        if num_drafts < 1:
            raise BPDConfigError(f"num_drafts must be >= 1, got {num_drafts}")
        hidden = self._sync(list(context))
        chosen, score = [], 0.0
        for i in range(lattice.num_heads):
            candidates = lattice.tokens[i]
            combined = lattice.logprobs[i] + self.alpha * self._scores(hidden, candidates)
            best = int(combined.argmax())
            chosen.append(int(candidates[best]))
            score += float(combined[best])
            if i + 1 < lattice.num_heads:
                hidden = self._advance([chosen[-1]])
        # One greedy draft (Alg. 2); further drafts, if asked for, are the heads' own next-best paths.
        drafts = [Draft(tuple(chosen), score)]
        for d in lattice.best_paths(num_drafts + 1):
            if len(drafts) < num_drafts and d.tokens != drafts[0].tokens:
                drafts.append(d)
        return drafts


def truncated_base(base: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A cheap rescorer LM derived from the base: its embeddings, first `num_layers` decoder layers, final norm and
    output layer (copied weights, same vocabulary). Trained further with a LoRA (training/train_rescorer.py)."""
    import copy

    config = copy.deepcopy(base.config)
    text = config.get_text_config()
    if not 1 <= num_layers <= text.num_hidden_layers:
        raise BPDConfigError(f"num_layers must be in [1, {text.num_hidden_layers}], got {num_layers}")
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:num_layers]
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the rescorer is a plain model: a quantized base's weights are dequantized
    small = AutoModelForCausalLM.from_config(config, dtype=base.dtype)
    state, missing = {}, []
    for name in small.state_dict():
        tensor = _base_tensor(base, name)
        if tensor is None:
            missing.append(name)
        elif type(tensor) in (torch.Tensor, torch.nn.Parameter) and not tensor.is_quantized:
            state[name] = tensor.detach()
        else:  # a weight-quantized base (optimum-quanto, ...) holds quantized tensors: their dequantized values
            with torch.no_grad():  # (dequantize() on a plain Parameter would make it a non-leaf: never called there)
                state[name] = tensor.dequantize().detach()
    if missing:
        raise BPDConfigError(f"cannot derive a rescorer from {type(base).__name__}: no weights for {missing[:2]}")
    small.load_state_dict(state)
    return small.eval()


def _base_tensor(base: PreTrainedModel, name: str) -> torch.Tensor | None:
    """The base's parameter or buffer `name` (None when it has none by that name); an int8 layer's weight
    (`hf_bpd.runtime.int8_weights`) dequantized."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = base.get_submodule(owner)
    except AttributeError:
        module = None
    if leaf == "weight" and hasattr(module, "dequantized_weight"):
        with torch.no_grad():
            return module.dequantized_weight()
    for get in (base.get_parameter, base.get_buffer):
        try:
            return get(name)
        except AttributeError:
            continue
    return None


def _first_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."


@contextlib.contextmanager
def quiet_peft():
    """Silence the FutureWarning transformers prints when peft wraps a model (`is_gradient_checkpointing` is
    deprecated): it is addressed to peft's maintainers, not to hf_bpd's users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        yield
