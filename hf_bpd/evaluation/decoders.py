"""The benchmarked decoding methods: one *decoder* each, `decoder(model, inputs, max_new_tokens) -> (sequences,
stats)`, where `inputs` holds `input_ids` `(1, prompt_len)` and `attention_mask`, `sequences` is `(1, prompt_len +
new)` and `stats` a `GenerationStats` (or None when the decoder cannot say). `default_decoders(options)` builds the
registry of the methods below; `hf_bpd.evaluation.bench.run_bench(..., decoders=...)` accepts any registry.

| method | what runs |
| --- | --- |
| `ar` | the base's plain greedy `generate()`: the reference every other method must reproduce |
| `llama.cpp` | llama.cpp's plain greedy decoding of the base's GGUF (`llama-cpp-python`, optional; `hf_bpd.evaluation.llama_cpp`) |
| `llama.cpp-specK` (K in 1, 2, 3, 4, 6, 8, 12, 16) | llama.cpp's speculative decoding: the `--assistant-model`'s packaged GGUF (or `--draft-gguf`) drafts K greedy tokens a step |
| `pld` | transformers' prompt lookup decoding (`prompt_lookup_num_tokens`) on the base |
| `early-exit` | transformers' self-speculation (`assistant_early_exit`) on the base |
| `assisted` | transformers' assisted generation: a small draft model, `--assistant-model` (`Assistant`) |
| `bpd` | blockwise parallel decoding, argmax (chain) drafts |
| `bpd+ngram`, `bpd+neural` | one draft from the lattice rescored by the checkpoint's bundled rescorer |
| `pbest` | `--num-drafts` best lattice paths under the heads alone ("p-best 0-gram"), verified as a tree |
| `pbest-ngram` | `--num-drafts` best n-gram-rescored paths, verified as a tree |
| `pbest-ngram+lookup` (and `-compiled`) | the same plus prompt lookup's copy as one more path (compiled: one tree-shaped compiled block) |
| `tree` | a Medusa-style sparse tree of top-k ranks (`--tree` widths) |
| `tree+ngram` | n-gram-rescored p-best drafts as a tree, with as many drafts as the `--tree` has leaves |
| `ar-compiled`, `bpd-compiled`, `bpd+NAME-compiled` | plain decoding / BPD with `generate(compile=True)`: compiled verification steps on a reused static cache (compiled in the warm-up) |
| `...-cost` (e.g. `bpd+ngram-compiled-cost`) | the same with `draft_schedule="cost"`: each step verifies only the drafted tokens expected to pay for their cost |
| `...-switch` | the same with `draft_schedule="switch"`: plain one-token steps while drafting does not pay in the call |
| `bpd+lookup`, `bpd+NAME+lookup` (and `-compiled`, `-cost`) | the chain plus prompt lookup's path, verified together (`prompt_lookup=True`) |
| `default` | `model.generate()` with nothing but the checkpoint's own `generation_config.json` (what a user gets) |
| `default-fixed`, `default-cost`, `default-switch` | the checkpoint's defaults with `draft_schedule="fixed"` (every step drafts), `"cost"` or `"switch"` |
| `default-fp32-heads` | the same with `heads_int8=False`: the heads step reads the heads' own fp32 weights |

Serial calls: `GenerationStats` counts them for BPD; for `ar` they are the new tokens; for `pld`/`early-exit`/`assisted`
they are the verification passes of transformers' assisted loop (one full-depth base forward each), recorded with
public module hooks on the base (no method of transformers is replaced; the assistant's own forwards are not the
base's, so they are not counted); their drafting time is not separated.

"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import BPDConfigError, MethodSkipped  # noqa: F401 - MethodSkipped is part of this module's interface
from ..generation.stats import GenerationStats
from ..rescorers.registry import available_rescorers
from .llama_cpp import decode_llama_cpp

Decoder = Callable[..., tuple[torch.Tensor, GenerationStats | None]]

REFERENCE = "ar"


SPEC_DRAFT_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # the draft lengths of the llama.cpp-specK methods


@dataclass
class BenchOptions:
    """Settings of the default decoders."""

    tree_widths: tuple[int, ...] = (4, 2, 2, 1)
    num_drafts: int = 4
    draft_top_k: int | None = None
    pld_tokens: int = 10
    early_exit_layer: int | None = None  # default: half the base's layers
    num_heads_to_use: int | None = None  # chain methods draft with the first heads only (None: the checkpoint's)
    draft_nodes: int = 15  # the -nodes methods: draft tokens per verification, filled best-first
    gguf: str | None = None  # the llama.cpp method's GGUF file (None: the packaged base's)
    draft_gguf: str | None = None  # llama.cpp-specK's draft model (None: the packaged GGUF of `assistant`)
    assistant: str | None = None  # the assisted method's draft model, a name for `hf_bpd.load_base` (None: skipped)




# ------------------------------------------------------------------ decoders
def base_of(model):
    """The plain causal LM: `model.base_lm` for a BPD model, else the model itself."""
    return getattr(model, "base_lm", model)


def decode_ar(model, inputs: dict, max_new_tokens: int):
    """Plain greedy `generate()` of the base: one serial call per new token."""
    out = base_of(model).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out.shape[1] - inputs["input_ids"].shape[1]
    return out, GenerationStats(method="ar", new_tokens=new, accepted_lengths=[0] * new)


class _PassRecorder:
    """Records the base's verification passes during a `generate()` with public module hooks only.

    A forward pre-hook on the base records where each call starts (the KV cache's `get_seq_length()`) and a hook on
    its last decoder layer marks the calls that ran the whole model: drafting passes of early exit stop before that
    layer, so only verification passes count as serial calls.
    """

    def __init__(self, base):
        self.base = base
        decoder = base.get_decoder()
        layers = getattr(decoder, "layers", None)
        if layers is None or len(layers) == 0:
            raise MethodSkipped(f"cannot find the decoder layers of {type(base).__name__} to count its passes")
        self.last_layer = layers[-1]
        self.calls: list[list] = []  # [start position, ran the last layer]

    def __enter__(self):
        def started(_module, _args, kwargs):
            cache = kwargs.get("cache")  # transformers >= 5.24 passes the cache as cache=, earlier as past_key_values=
            cache = kwargs.get("past_key_values") if cache is None else cache
            self.calls.append([cache.get_seq_length() if cache is not None else 0, False])

        def full_depth(_module, _args, _output):
            if self.calls:
                self.calls[-1][1] = True

        self.handles = [self.base.register_forward_pre_hook(started, with_kwargs=True),
                        self.last_layer.register_forward_hook(full_depth)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def accepted_lengths(self, prompt_length: int, final_length: int) -> list[int]:
        """Draft tokens accepted by each verification pass, from where the next one starts (transformers' assisted
        loop verifies the prompt with the first drafts, and feeds each pass the last pass's bonus token first)."""
        starts = [start for start, full in self.calls if full]
        ends = starts[1:] + [final_length - 1]
        out = []
        for i, (start, end) in enumerate(zip(starts, ends)):
            out.append(max(end - (prompt_length if i == 0 else start + 1), 0))
        return out


def decode_assisted(model, inputs: dict, max_new_tokens: int, method: str = "assisted", **generate_kwargs):
    """The base's `generate()` with one of transformers' own drafting methods (`prompt_lookup_num_tokens=...`,
    `assistant_early_exit=...`); serial calls and accepted lengths are recorded with module hooks (`_PassRecorder`)."""
    base = base_of(model)
    stats = GenerationStats(method=method)
    start = time.perf_counter()
    with _PassRecorder(base) as recorder:
        out = base.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs)
    stats.total_seconds = time.perf_counter() - start
    stats.new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    stats.accepted_lengths = recorder.accepted_lengths(inputs["input_ids"].shape[1], out.shape[1])
    return out, stats


class Assistant:
    """The `assisted` method's draft model: `name` (a local directory, packaged alias or Hub id, as for
    `hf_bpd.load_base`) is loaded on first use in the base's dtype and on its device, then kept for the bench run."""

    def __init__(self, name: str | None):
        self.name = name
        self.model = None
        self._tokenizer = None

    def for_base(self, base):
        """The assistant, in `base`'s dtype and on its device."""
        if self.name is None:
            raise MethodSkipped("no assistant model: pass --assistant-model NAME (a small model with the base's "
                                "tokenizer, e.g. qwen2.5-coder-0.5b-instruct for a Qwen2.5-Coder base)")
        if self.model is None:
            from ..hub.base_models import load_base_model

            try:
                self.model = load_base_model(self.name, dtype=base.dtype)
            except (OSError, ValueError) as err:  # hf_bpd's BaseModelError is a ValueError
                raise MethodSkipped(f"assistant model {self.name}: {str(err).strip().splitlines()[0]}") from err
        if (self.model.dtype, self.model.device) != (base.dtype, base.device):
            self.model.to(device=base.device, dtype=base.dtype)
        return self.model

    def tokenizer(self):
        """The assistant's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            from ..hub.base_models import load_tokenizer

            self._tokenizer = load_tokenizer(self.name)
        return self._tokenizer


def decode_assistant_model(model, inputs: dict, max_new_tokens: int, assistant: Assistant):
    """The base's greedy `generate(assistant_model=...)`: transformers' speculative decoding with a separate draft
    model. Where the two configs' vocabulary sizes differ (a padded embedding) transformers wants both tokenizers: the
    assistant's serves for both, since the method needs the base's tokenizer. What transformers refuses is skipped."""
    base = base_of(model)
    helper = assistant.for_base(base)
    sizes = [m.config.get_text_config().vocab_size for m in (base, helper)]
    try:
        extra = {} if sizes[0] == sizes[1] else {"tokenizer": assistant.tokenizer(),
                                                 "assistant_tokenizer": assistant.tokenizer()}
        return decode_assisted(model, inputs, max_new_tokens, method="assisted", assistant_model=helper, **extra)
    except MethodSkipped:
        raise
    except Exception as err:  # noqa: BLE001 - an assistant transformers cannot use is a note, not a crash
        vocab = "" if sizes[0] == sizes[1] else f" (vocabulary {sizes[1]} against the base's {sizes[0]})"
        reason = (str(err).strip().splitlines() or [""])[0]
        raise MethodSkipped(f"transformers' assisted generation with {assistant.name}{vocab} failed: "
                            f"{type(err).__name__}: {reason}") from err


def decode_early_exit(model, inputs: dict, max_new_tokens: int, layer: int | None = None):
    base = base_of(model)
    layers = getattr(base.config.get_text_config(), "num_hidden_layers", None)
    if not layers or layers < 2:
        raise MethodSkipped(f"early exit needs a base with at least 2 layers, this one has {layers}")
    layer = layer or max(layers // 2, 1)
    if not 1 <= layer < layers:
        raise BPDConfigError(f"--early-exit-layer must be in [1, {layers - 1}], got {layer}")
    return decode_assisted(model, inputs, max_new_tokens, method="early-exit", assistant_early_exit=layer)


_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plain base -> its compiled plain wrapper


def plain_wrapper(base):
    """`base` wrapped with one fresh head (never drafted with), kept per base so its compiled steps are reused."""
    from ..modeling import BlockwiseParallelForCausalLM

    if base not in _WRAPPERS:
        _WRAPPERS[base] = BlockwiseParallelForCausalLM.from_base(base, num_heads=1).eval()
    return _WRAPPERS[base]


def decode_bpd(model, inputs: dict, max_new_tokens: int, tree_widths: Sequence[int] | None = None,
               tree_leaves_as_drafts: bool = False, **options):
    """`model.generate()` with drafting heads; `tree_widths` are cut to the heads in use. Plain decoding through the
    compiled machinery (`use_heads=False`) also serves a plain base: it runs in a wrapper with one unused head."""
    if not hasattr(model, "heads"):
        if options.get("use_heads", True):
            raise MethodSkipped("the model has no drafting heads (a plain base model): pass a heads checkpoint")
        model = plain_wrapper(model)
    if tree_widths is not None:
        in_use = options.get("num_heads_to_use") or model.generation_config.num_heads_to_use or model.config.num_heads
        widths = tuple(tree_widths)[:in_use]
        if tree_leaves_as_drafts:
            options["num_drafts"] = math.prod(widths)
        else:
            options["tree"] = widths
    if options.get("compile", getattr(model.generation_config, "compile", False)) is True:
        options["compile"] = "wait"  # a benchmark times the compiled step, not eager verification while it builds
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
    return out, model.last_generation_stats


def decode_feature(model, inputs: dict, max_new_tokens: int, **options):
    """`model.generate(drafter="feature")`: the checkpoint's feature-level drafter drafts."""
    if getattr(model, "feature_drafter", None) is None:
        raise MethodSkipped("the checkpoint has no feature-level drafter (feature_drafter/)")
    if options.get("compile", getattr(model.generation_config, "compile", False)) is True:
        options["compile"] = "wait"  # as for decode_bpd: the compiled step, not eager verification while it builds
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, drafter="feature", **options)
    return out, model.last_generation_stats


def default_decoders(options: BenchOptions | None = None) -> dict[str, Decoder]:
    """The registry of methods: name -> `decoder(model, inputs, max_new_tokens)`. `bpd+NAME` exists for every
    registered rescorer (`hf_bpd.available_rescorers()`)."""
    o = options or BenchOptions()
    k = {} if o.draft_top_k is None else {"draft_top_k": o.draft_top_k}
    p = functools.partial
    # Explicit options: a checkpoint's own defaults (generation_config.rescorer, num_drafts, tree) must not change
    # what a method name means. rescorer=None: the heads' own scores.
    chain = dict(num_drafts=1, tree=None, draft_nodes=None)
    if o.num_heads_to_use is not None:
        chain["num_heads_to_use"] = o.num_heads_to_use
    decoders = {
        "ar": decode_ar,
        "pld": p(decode_assisted, method="pld", prompt_lookup_num_tokens=o.pld_tokens),
        "early-exit": p(decode_early_exit, layer=o.early_exit_layer),
        "assisted": p(decode_assistant_model, assistant=Assistant(o.assistant)),  # loaded once, on first use
        "llama.cpp": p(decode_llama_cpp, gguf=o.gguf),
    }
    for n in SPEC_DRAFT_TOKENS:  # llama.cpp's speculative decoding, the draft model drafting n tokens a step
        decoders[f"llama.cpp-spec{n}"] = p(decode_llama_cpp, gguf=o.gguf, draft_tokens=n, draft_gguf=o.draft_gguf,
                                           assistant=o.assistant)
    # Chain BPD in every combination: rescorer (+NAME), prompt-lookup path (+lookup), compiled verification
    # (-compiled: `generate(compile=True)`, a compiled step on a reused static cache) and cost-aware drafting (-cost).
    # `ar-compiled` is plain decoding through the compiled machinery (one token per step): the fair baseline for it.
    for compiled in (False, True):
        if compiled:
            decoders["ar-compiled"] = p(decode_bpd, use_heads=False, compile=True)
        for schedule in ("fixed", "cost", "switch"):
            for lookup in (False, True):
                for name in (None, *available_rescorers()):
                    method = "bpd" + (f"+{name}" if name else "") + ("+lookup" if lookup else "") + \
                        ("-compiled" if compiled else "") + ("" if schedule == "fixed" else f"-{schedule}")
                    decoders[method] = p(decode_bpd, rescorer=name, compile=compiled, draft_schedule=schedule,
                                         prompt_lookup=lookup, **chain, **({} if name is None else k))
    # The checkpoint's own generate() defaults (its generation_config.json), whatever they are; and the same with
    # the heads' own fp32 weights in the heads step (the default drafts with int8 weights where it can).
    decoders["default"] = decode_bpd
    decoders["default-fixed"] = p(decode_bpd, draft_schedule="fixed")  # the defaults, every step drafting
    decoders["default-cost"] = p(decode_bpd, draft_schedule="cost")  # the defaults, verifying the nodes that pay
    decoders["default-switch"] = p(decode_bpd, draft_schedule="switch")  # the defaults, plain steps where drafting
    # does not pay (`hf_bpd.generation.controller.StepSwitch`)
    # the feature-level drafter's chain, alone and with prompt lookup's copy; eager, or compiled as the checkpoint's
    decoders["feature"] = p(decode_feature, prompt_lookup=False, compile=False)
    decoders["feature+lookup"] = p(decode_feature, prompt_lookup=True, compile=False)
    decoders["feature-compiled"] = p(decode_feature, prompt_lookup=False, compile=True)
    decoders["feature+lookup-compiled"] = p(decode_feature, prompt_lookup=True, compile=True)
    decoders["default-fp32-heads"] = p(decode_bpd, heads_int8=False)
    # p-best and trees: eager, heads only (a checkpoint's compile / prompt_lookup / schedule defaults do not apply)
    plain = dict(compile=False, prompt_lookup=False, draft_schedule="fixed", draft_nodes=None)
    if o.num_heads_to_use is not None:
        plain["num_heads_to_use"] = o.num_heads_to_use
    decoders.update({
        "pbest": p(decode_bpd, rescorer=None, num_drafts=o.num_drafts, tree=None, **plain, **k),
        "pbest-ngram": p(decode_bpd, rescorer="ngram", num_drafts=o.num_drafts, tree=None, **plain, **k),
        # the p-best n-gram paths plus prompt lookup's copy as one more path, eagerly or as a compiled tree
        "pbest-ngram+lookup": p(decode_bpd, rescorer="ngram", num_drafts=o.num_drafts, tree=None,
                                **{**plain, "prompt_lookup": True}, **k),
        "pbest-ngram+lookup-compiled": p(decode_bpd, rescorer="ngram", num_drafts=o.num_drafts, tree=None,
                                         **{**plain, "prompt_lookup": True, "compile": True}, **k),
        # the same paths and copy competing for a budget of draft nodes (`draft_nodes`): one block of 1 + N tokens
        "pbest-ngram+lookup-nodes": p(decode_bpd, rescorer="ngram", num_drafts=o.num_drafts, tree=None,
                                      **{**plain, "prompt_lookup": True, "draft_nodes": o.draft_nodes}, **k),
        "pbest-ngram+lookup-nodes-compiled": p(decode_bpd, rescorer="ngram", num_drafts=o.num_drafts, tree=None,
                                               **{**plain, "prompt_lookup": True, "compile": True,
                                                  "draft_nodes": o.draft_nodes}, **k),
        "tree": p(decode_bpd, rescorer=None, tree_widths=o.tree_widths, **plain),
        "tree+ngram": p(decode_bpd, rescorer="ngram", tree_widths=o.tree_widths, tree_leaves_as_drafts=True,
                        tree=None, **plain, **k),
    })
    return decoders


# What `hf-bpd bench` runs without --methods: the paper's methods, transformers' own and the checkpoint's default
# (the other combinations are named explicitly; compiled ones compile for minutes first).
DEFAULT_METHODS = ("ar", "ar-compiled", "llama.cpp", "pld", "early-exit", "bpd", "bpd+ngram", "bpd+neural", "pbest",
                   "pbest-ngram", "tree", "tree+ngram", "default")


def methods() -> list[str]:
    """Every method name `default_decoders` knows."""
    return list(default_decoders())


def parse_methods(text: str | Sequence[str] | None, known: Sequence[str]) -> list[str]:
    """Method names from `"a,b,c"` (None: every known method); `ar` always runs first (it is the reference)."""
    names = list(known) if text is None else [m.strip() for m in
                                              (text.split(",") if isinstance(text, str) else text) if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown:
        raise BPDConfigError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    return [REFERENCE] + [m for m in dict.fromkeys(names) if m != REFERENCE]
