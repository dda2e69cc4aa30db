"""`hf-bpd bench`: decoding methods side by side on a prompt file, against plain greedy decoding in the same run.

Each method is a *decoder*: `decoder(model, inputs, max_new_tokens) -> (sequences, stats)`, where `inputs` holds
`input_ids` `(1, prompt_len)` and `attention_mask`, `sequences` is `(1, prompt_len + new)` and `stats` a
`GenerationStats` (or None when the decoder cannot say). `default_decoders(options)` builds the registry of the
methods below; `run_bench(..., decoders=...)` accepts any registry, so tests (or users) can add their own.

| method | what runs |
| --- | --- |
| `ar` | the base's plain greedy `generate()`: the reference every other method must reproduce |
| `pld` | transformers' prompt lookup decoding (`prompt_lookup_num_tokens`) on the base |
| `early-exit` | transformers' self-speculation (`assistant_early_exit`) on the base |
| `bpd` | blockwise parallel decoding, argmax (chain) drafts |
| `bpd+ngram`, `bpd+neural` | one draft from the lattice rescored by the checkpoint's bundled rescorer |
| `pbest` | `--num-drafts` best lattice paths under the heads alone ("p-best 0-gram"), verified as a tree |
| `pbest-ngram` | `--num-drafts` best n-gram-rescored paths, verified as a tree |
| `pbest-ngram+lookup` (and `-compiled`) | the same plus prompt lookup's copy as one more path (compiled: one tree-shaped compiled block) |
| `tree` | a Medusa-style sparse tree of top-k ranks (`--tree` widths) |
| `tree+ngram` | n-gram-rescored p-best drafts as a tree, with as many drafts as the `--tree` has leaves |
| `ar-compiled`, `bpd-compiled`, `bpd+NAME-compiled` | plain decoding / BPD with `generate(compile=True)`: compiled verification steps on a reused static cache (compiled in the warm-up) |
| `...-cost` (e.g. `bpd+ngram-compiled-cost`) | the same with `draft_schedule="cost"`: each step verifies only the drafted tokens expected to pay for their cost |
| `bpd+lookup`, `bpd+NAME+lookup` (and `-compiled`, `-cost`) | the chain plus prompt lookup's path, verified together (`prompt_lookup=True`) |
| `default` | `model.generate()` with nothing but the checkpoint's own `generation_config.json` (what a user gets) |
| `default-fp32-heads` | the same with `heads_int8=False`: the heads step reads the heads' own fp32 weights |

Serial calls: `GenerationStats` counts them for BPD; for `ar` they are the new tokens; for `pld`/`early-exit` they are
the verification passes of transformers' assisted loop (one full-depth base forward each), recorded with public
module hooks on the base (no method of transformers is replaced); their drafting time is not separated.

The report (`run_bench`; `hf-bpd bench --output` adds `settings` and `machine`: cpu, cpu_count, threads, torch,
transformers, ...):

* `methods`: the methods that ran, `ar` first; `skipped`: `{method: reason}`.
* `summary`: one row per method over every prompt, `by_category`: one per (category, method). Row keys: `method`,
  `category`, `samples`, `new_tokens`, `seconds`, `tokens_per_s` (new tokens / seconds), `speedup_vs_ar` (tokens/s
  over ar's on the same prompts), `block_efficiency` (new tokens / serial calls), `serial_calls`, `mean_accepted`
  (accepted draft tokens per serial call after the first), `draft_share` (drafting time / total time), `exact`
  (every output token-identical to ar's) and `exact_rate`.
* `samples`: one record per (prompt, turn, method): `id`, `category`, `turn`, `method`, `prompt_tokens`,
  `new_tokens`, `seconds`, `tokens_per_s`, `speedup_vs_ar` (ar's seconds / this method's), `serial_calls`,
  `block_efficiency`, `mean_accepted`, `accepted_lengths` and `draft_tokens` (per serial call), `draft_seconds`,
  `tie_checks`/`tie_changes`/`tie_seconds` (near-ties the base's eager generate() decided), `output_ids`, `exact`.
  Figures that a decoder does not report are null.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..generation.stats import GenerationStats
from ..errors import BPDConfigError
from ..rescorers.base import available_rescorers

Decoder = Callable[..., tuple[torch.Tensor, GenerationStats | None]]

REFERENCE = "ar"


class MethodSkipped(Exception):
    """A method that does not apply to this model (no heads, no bundled rescorer, unsupported architecture)."""


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


# ------------------------------------------------------------------ prompts
def load_questions(path: str | Path) -> list[dict]:
    """`[{"id", "category", "turns"}]` from an MT-bench JSONL (`question_id`, `category`, `turns`), an Alpaca-style
    JSON/JSONL (`instruction`, `input`; any layout `hf_bpd.training.data.record_prompt` reads) or a text file (one prompt per
    line). Identical prompts are kept once."""
    from ..training.data import prompt_id, record_prompt

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no questions file at {path}: pass a .jsonl/.json/.txt prompt file")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records, where = [], []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number} is not valid JSON ({err.msg})") from None
                where.append(f"{path}:{number}")
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
        records = data if isinstance(data, list) else (data.get("data") or data.get("questions") or [data]
                                                       if isinstance(data, dict) else [data])
        where = [f"{path} record {i}" for i in range(1, len(records) + 1)] if isinstance(records, list) else []
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a list of JSON objects (MT-bench or Alpaca records)")
    else:
        records = [{"prompt": line} for line in text.splitlines() if line.strip()]
        where = [str(path)] * len(records)
    out, seen, bad = [], set(), []  # a record without a usable prompt is an error, never silently dropped
    for record, at in zip(records, where):
        if not isinstance(record, dict):
            raise ValueError(f"{at}: expected JSON objects (MT-bench or Alpaca records), got {type(record).__name__}")
        turns = record.get("turns")
        if "turns" in record:
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
                bad.append(f"{at}: 'turns' must be a non-empty list of non-empty strings, got "
                           f"{json.dumps(turns)[:60]}")
                continue
            turns = [t.strip() for t in turns]
        else:
            prompt = record_prompt(record)
            if not prompt:
                bad.append(f"{at} holds no prompt (no 'turns', 'instruction', 'prompt' or conversation)")
                continue
            turns = [prompt]
        if tuple(turns) in seen:
            continue
        seen.add(tuple(turns))
        qid = record.get("question_id") or record.get("id") or prompt_id(path.stem, turns[0])
        out.append({"id": str(qid), "category": str(record.get("category") or path.stem), "turns": turns})
    if not out:
        raise ValueError(f"no prompts in {path}: expected MT-bench (turns), Alpaca (instruction/input) records or "
                         "one prompt per line" + (f" ({bad[0]})" if bad else ""))
    if bad:
        raise ValueError(f"{bad[0]}: fix or remove the record" + (f" ({len(bad) - 1} more like it)"
                                                                 if len(bad) > 1 else ""))
    return out


def encode_messages(tokenizer, messages: list[dict], chat: bool | None = None, device=None) -> dict:
    """Token ids (`input_ids`, `attention_mask`, `(1, len)`, on `device`) for a conversation ending with a user turn.

    `chat=None` uses the tokenizer's chat template when it has one; without it the turns are joined by blank lines.
    """
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template: use --no-chat")
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
    else:
        encoded = tokenizer("\n\n".join(m["content"] for m in messages), return_tensors="pt")
    return {"input_ids": encoded["input_ids"].to(device), "attention_mask": encoded["attention_mask"].to(device)}


def first_turn_inputs(tokenizer, path: str | Path, limit: int | None = None) -> list[dict]:
    """The first user turn of each of the first `limit` questions of `path` (`load_questions`), encoded as one
    conversation each (`encode_messages`, chat template when the tokenizer has one): the benchmark scripts' prompts."""
    return [encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}])
            for q in load_questions(path)[:limit]]


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


def decode_early_exit(model, inputs: dict, max_new_tokens: int, layer: int | None = None):
    base = base_of(model)
    layers = getattr(base.config.get_text_config(), "num_hidden_layers", None)
    if not layers or layers < 2:
        raise MethodSkipped(f"early exit needs a base with at least 2 layers, this one has {layers}")
    layer = layer or max(layers // 2, 1)
    if not 1 <= layer < layers:
        raise BPDConfigError(f"--early-exit-layer must be in [1, {layers - 1}], got {layer}")
    return decode_assisted(model, inputs, max_new_tokens, method="early-exit", assistant_early_exit=layer)


def decode_bpd(model, inputs: dict, max_new_tokens: int, tree_widths: Sequence[int] | None = None,
               tree_leaves_as_drafts: bool = False, **options):
    """`model.generate()` with drafting heads; `tree_widths` are cut to the heads in use."""
    if not hasattr(model, "heads"):
        raise MethodSkipped("the model has no drafting heads (a plain base model): pass a heads checkpoint")
    if tree_widths is not None:
        in_use = options.get("num_heads_to_use") or model.generation_config.num_heads_to_use or model.config.num_heads
        widths = tuple(tree_widths)[:in_use]
        if tree_leaves_as_drafts:
            options["num_drafts"] = math.prod(widths)
        else:
            options["tree"] = widths
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
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
    }
    # Chain BPD in every combination: rescorer (+NAME), prompt-lookup path (+lookup), compiled verification
    # (-compiled: `generate(compile=True)`, a compiled step on a reused static cache) and cost-aware drafting (-cost).
    # `ar-compiled` is plain decoding through the compiled machinery (one token per step): the fair baseline for it.
    for compiled in (False, True):
        if compiled:
            decoders["ar-compiled"] = p(decode_bpd, use_heads=False, compile=True)
        for schedule in ("fixed", "cost"):
            for lookup in (False, True):
                for name in (None, *available_rescorers()):
                    method = "bpd" + (f"+{name}" if name else "") + ("+lookup" if lookup else "") + \
                        ("-compiled" if compiled else "") + ("-cost" if schedule == "cost" else "")
                    decoders[method] = p(decode_bpd, rescorer=name, compile=compiled, draft_schedule=schedule,
                                         prompt_lookup=lookup, **chain, **({} if name is None else k))
    # The checkpoint's own generate() defaults (its generation_config.json), whatever they are; and the same with
    # the heads' own fp32 weights in the heads step (the default drafts with int8 weights where it can).
    decoders["default"] = decode_bpd
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
DEFAULT_METHODS = ("ar", "pld", "early-exit", "bpd", "bpd+ngram", "bpd+neural", "pbest", "pbest-ngram", "tree",
                   "tree+ngram", "default")


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


# ------------------------------------------------------------------ running
def machine_info() -> dict:
    import transformers

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_bpd": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": list(load) if load else None,
    }


def _sample_record(question: dict, turn: int, method: str, prompt_length: int, new_ids: list[int], seconds: float,
                   stats: GenerationStats | None) -> dict:
    record = {
        "id": question["id"], "category": question["category"], "turn": turn, "method": method,
        "prompt_tokens": prompt_length, "new_tokens": len(new_ids), "seconds": seconds,
        "tokens_per_s": len(new_ids) / seconds if seconds > 0 else 0.0,
        "serial_calls": None, "block_efficiency": None, "mean_accepted": None, "accepted_lengths": None,
        "draft_tokens": None, "draft_seconds": None, "tie_checks": None, "tie_changes": None, "tie_seconds": None,
        "output_ids": new_ids,
    }
    if stats is not None:
        record.update(serial_calls=stats.serial_calls, block_efficiency=stats.block_efficiency,
                      mean_accepted=stats.mean_accepted, accepted_lengths=list(stats.accepted_lengths),
                      draft_tokens=list(stats.draft_tokens) or [0] * stats.serial_calls,
                      draft_seconds=stats.draft_seconds, tie_checks=stats.tie_checks, tie_changes=stats.tie_changes,
                      tie_seconds=stats.tie_seconds)
    return record


def summarize_samples(samples: list[dict], methods: Sequence[str], category: str = "all") -> list[dict]:
    """One row per method over `samples` (already filtered to one category, or all)."""
    rows = []
    ref = [s for s in samples if s["method"] == REFERENCE]
    ref_tps = sum(s["new_tokens"] for s in ref) / max(sum(s["seconds"] for s in ref), 1e-12) if ref else None
    for method in methods:
        mine = [s for s in samples if s["method"] == method]
        if not mine:
            continue
        new = sum(s["new_tokens"] for s in mine)
        seconds = sum(s["seconds"] for s in mine)
        tps = new / seconds if seconds > 0 else 0.0
        with_stats = [s for s in mine if s["serial_calls"] is not None]
        calls = sum(s["serial_calls"] for s in with_stats)
        steps = [a for s in with_stats for a in s["accepted_lengths"][1:]]
        drafted = sum(s["draft_seconds"] for s in with_stats)
        rows.append({
            "method": method,
            "category": category,
            "samples": len(mine),
            "new_tokens": new,
            "seconds": seconds,
            "tokens_per_s": tps,
            "speedup_vs_ar": tps / ref_tps if ref_tps else None,
            "block_efficiency": sum(s["new_tokens"] for s in with_stats) / calls if calls else None,
            "serial_calls": calls if with_stats else None,
            "mean_accepted": sum(steps) / len(steps) if steps else (0.0 if with_stats else None),
            "draft_share": drafted / seconds if with_stats and seconds > 0 else None,
            "exact": all(s["exact"] for s in mine),
            "exact_rate": sum(s["exact"] for s in mine) / len(mine),
        })
    return rows


def run_bench(model, tokenizer, questions: Sequence[dict], methods: Sequence[str] | None = None,
              decoders: dict[str, Decoder] | None = None, max_new_tokens: int = 128, chat: bool | None = None,
              multi_turn: bool = False, warmup: int = 1, progress: bool = True, log=None) -> dict:
    """Run `methods` (default: every decoder) on every question; returns the report (see `hf-bpd bench --help`).

    `decoders` is the registry (default `default_decoders()`); it must hold `ar`, the reference. Methods run in a
    different order for each prompt (rotated), so slow drift of the machine's speed spreads over all of them;
    `warmup` generations per method (up to 32 new tokens, on the first prompt) run first and are not counted. A
    method that raises `MethodSkipped` or `BPDConfigError` (or any error) is reported under `skipped` with the reason.
    """
    from tqdm.auto import tqdm

    decoders = dict(default_decoders() if decoders is None else decoders)
    if REFERENCE not in decoders:
        raise BPDConfigError(f"the decoder registry needs {REFERENCE!r} (plain greedy), the reference")
    methods = parse_methods(methods, list(decoders))
    if not questions:
        raise ValueError("no prompts to benchmark")
    log = log or (lambda message: None)
    skipped: dict[str, str] = {}

    def call(name, inputs, budget):
        start = time.perf_counter()
        with torch.no_grad():
            sequences, stats = decoders[name](model, inputs, budget)
        seconds = time.perf_counter() - start
        if not isinstance(sequences, torch.Tensor):
            sequences = sequences.sequences
        return sequences, stats, seconds

    def skip(name, err):
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not isinstance(err, (MethodSkipped, BPDConfigError)):
            reason = f"failed: {type(err).__name__}: {reason}"
        skipped[name] = reason
        log(f"skipping {name}: {reason}")

    first = encode_messages(tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}], chat, model.device)
    active = []
    for name in methods:
        try:
            for _ in range(max(warmup, 0)):
                call(name, first, min(max_new_tokens, 32))
            active.append(name)
        except Exception as err:  # noqa: BLE001 - an inapplicable method is reported, not fatal
            if name == REFERENCE:
                raise
            skip(name, err)

    total = sum(len(q["turns"]) if multi_turn else 1 for q in questions) * len(active)
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not progress)
    samples: list[dict] = []
    position = 0
    for question in questions:
        messages: list[dict] = []
        for turn, content in enumerate(question["turns"] if multi_turn else question["turns"][:1], 1):
            messages.append({"role": "user", "content": content})
            inputs = encode_messages(tokenizer, messages, chat, model.device)
            prompt_length = inputs["input_ids"].shape[1]
            order = active[position % len(active):] + active[: position % len(active)]
            position += 1
            results = {}
            for name in order:
                if name in skipped:
                    continue
                try:
                    sequences, stats, seconds = call(name, inputs, max_new_tokens)
                except Exception as err:  # noqa: BLE001
                    if name == REFERENCE:
                        raise
                    skip(name, err)
                    continue
                finally:
                    bar.update(1)
                new_ids = sequences[0, prompt_length:].tolist()
                results[name] = _sample_record(question, turn, name, prompt_length, new_ids, seconds, stats)
            reference = results[REFERENCE]
            for record in results.values():
                record["exact"] = record["output_ids"] == reference["output_ids"]
                record["speedup_vs_ar"] = reference["seconds"] / record["seconds"] if record["seconds"] > 0 else None
                samples.append(record)
            # later turns continue the reference's conversation, so every method sees the same prompt
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(reference["output_ids"], skip_special_tokens=True)})
    bar.close()
    samples = [s for s in samples if s["method"] not in skipped]
    ran = [m for m in methods if m not in skipped]
    categories = sorted({s["category"] for s in samples})
    by_category = [row for c in categories
                   for row in summarize_samples([s for s in samples if s["category"] == c], ran, c)]
    return {
        "methods": ran,
        "skipped": skipped,
        "summary": summarize_samples(samples, ran),
        "by_category": by_category,
        "samples": samples,
    }


# ------------------------------------------------------------------ rendering
def _fmt(value, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    return format(value, spec) if isinstance(value, float) else str(value)


def markdown_report(report: dict) -> str:
    header = ("| method | tok/s | speed-up vs ar | block efficiency | mean accepted | draft time | exact |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | :---: |")

    def row(r, label):
        share = None if r["draft_share"] is None else 100 * r["draft_share"]
        return (f"| {label} | {_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['speedup_vs_ar'])}x | "
                f"{_fmt(r['block_efficiency'])} | {_fmt(r['mean_accepted'])} | "
                f"{_fmt(share, '.1f')}{'' if share is None else '%'} | {_fmt(r['exact'])} |")

    lines = [header] + [row(r, r["method"]) for r in report["summary"]]
    categories = sorted({r["category"] for r in report["by_category"]})
    if len(categories) > 1:
        lines += ["", "Per category:", "", header.replace("| method |", "| category / method |")]
        lines += [row(r, f"{r['category']} / {r['method']}") for r in report["by_category"]]
    if report["skipped"]:
        lines += ["", "Skipped:"] + [f"- `{m}`: {reason}" for m, reason in report["skipped"].items()]
    return "\n".join(lines) + "\n"


def plot_report(report: dict, directory) -> list[str]:
    """`speedup.png` and `block_efficiency.png`: one bar per method, grouped by category (plus all)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    categories = sorted({r["category"] for r in report["by_category"]})
    rows = report["summary"] + (report["by_category"] if len(categories) > 1 else [])
    groups = list(dict.fromkeys(r["category"] for r in rows))
    methods = report["methods"]
    written = []
    for key, label in (("speedup_vs_ar", "speed-up vs plain greedy"), ("block_efficiency", "block efficiency")):
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(len(methods), 1) / 3), 4))
        width = 0.8 / max(len(methods), 1)
        for i, method in enumerate(methods):
            values = [next((r[key] for r in rows if r["category"] == g and r["method"] == method), None) or 0.0
                      for g in groups]
            ax.bar([x + i * width for x in range(len(groups))], values, width, label=method)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(groups))], groups)
        ax.set_ylabel(label)
        ax.legend(fontsize="small", ncols=2)
        fig.tight_layout()
        path = directory / f"{key.replace('_vs_ar', '')}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written



# ------------------------------------------------------------------ batches
def left_pad(rows: Sequence[torch.Tensor], pad_id: int, device=None) -> dict:
    """`input_ids` / `attention_mask` of token-id rows, left-padded with `pad_id` (what batched decoding needs)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _new_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS (the padding after it dropped)."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:end])
    return rows


def run_batch_bench(model, tokenizer, questions: Sequence[dict], batch_sizes: Sequence[int],
                    max_new_tokens: int = 128, chat: bool | None = None, warmup: int = 1, progress: bool = True,
                    log=None) -> dict:
    """Batched drafting against transformers' batched plain greedy `generate()`, both eager, on the same left-padded
    batches of consecutive prompts, alternating which runs first; per batch size: tokens/s both ways, the ratio, the
    rows' pooled block efficiency, and how many rows are token-identical to plain batched decoding."""
    from tqdm.auto import tqdm

    if not hasattr(model, "heads"):
        raise MethodSkipped("the model has no drafting heads (a plain base model): pass a heads checkpoint")
    log = log or (lambda message: None)
    base = base_of(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], chat)["input_ids"][0]
               for q in questions]
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    decoders = {"plain": lambda batch: base.generate(**batch, **settings),
                "bpd": lambda batch: model.generate(**batch, **settings, compile=False)}
    results = []
    for size in batch_sizes:
        batches = [left_pad(prompts[i: i + size], pad_id, model.device) for i in range(0, len(prompts), size)]
        for _ in range(max(warmup, 0)):
            for decode in decoders.values():
                decode({k: v[:, -64:] for k, v in batches[0].items()})
        seconds, tokens, exact, rows, row_calls, passes = {"plain": 0.0, "bpd": 0.0}, {"plain": 0, "bpd": 0}, 0, 0, 0, 0
        for i, batch in enumerate(tqdm(batches, desc=f"batch {size}", disable=not progress)):
            outputs = {}
            for name in (["plain", "bpd"] if i % 2 == 0 else ["bpd", "plain"]):
                start = time.perf_counter()
                out = decoders[name](batch)
                seconds[name] += time.perf_counter() - start
                outputs[name] = _new_tokens(out, batch["input_ids"].shape[1], eos_ids)
                tokens[name] += sum(len(r) for r in outputs[name])
                if name == "bpd":
                    stats = model.last_generation_stats
                    rows_stats = stats.rows or [stats]
                    row_calls += sum(r.serial_calls for r in rows_stats)
                    passes += stats.forward_passes or stats.serial_calls
            exact += sum(a == b for a, b in zip(outputs["plain"], outputs["bpd"]))
            rows += len(outputs["plain"])
        result = {"batch_size": size, "prompts": rows, "plain_tokens_per_s": tokens["plain"] / seconds["plain"],
                  "bpd_tokens_per_s": tokens["bpd"] / seconds["bpd"],
                  "block_efficiency": tokens["bpd"] / row_calls if row_calls else None,
                  "forward_passes": passes, "identical_rows": exact}
        result["speedup"] = result["bpd_tokens_per_s"] / result["plain_tokens_per_s"]
        log(f"batch {size}: plain {result['plain_tokens_per_s']:.1f} tok/s, bpd {result['bpd_tokens_per_s']:.1f} "
            f"tok/s ({result['speedup']:.2f}x), block efficiency {result['block_efficiency']:.2f}, "
            f"{exact}/{rows} rows identical")
        results.append(result)
    return {"batches": results}


def markdown_batch_report(report: dict) -> str:
    lines = ["| batch size | plain batched generate() tok/s | batched BPD tok/s | speed-up | block efficiency | "
             "identical rows |", "| ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in report["batches"]:
        lines.append(f"| {r['batch_size']} | {r['plain_tokens_per_s']:.1f} | {r['bpd_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {_fmt(r['block_efficiency'])} | {r['identical_rows']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"
