"""`hf-bpd bench`: decoding methods side by side on a prompt file, against plain greedy decoding in the same run.

Each method is a *decoder*: `decoder(model, inputs, max_new_tokens) -> (sequences, stats)`, where `inputs` holds
`input_ids` `(1, prompt_len)` and `attention_mask`, `sequences` is `(1, prompt_len + new)` and `stats` a
`GenerationStats` (or None when the decoder cannot say). `default_decoders(options)` builds the registry of the
methods below; `run_bench(..., decoders=...)` accepts any registry, so tests (or users) can add their own.

The methods (`hf_bpd.evaluation.decoders`): `ar` is the reference every other method must reproduce; see that
module for the list. Batched decoding is benchmarked by `hf_bpd.evaluation.batch_bench`.

The report (`run_bench`; `hf-bpd bench --output` adds `settings` and `machine`: cpu, cpu_capability, cpu_count, threads, torch,
transformers, ...):

* `methods`: the methods that ran, `ar` first; `skipped`: `{method: reason}`.
* `summary`: one row per method over every prompt, `by_category`: one per (category, method). Row keys: `method`,
  `category`, `samples`, `new_tokens`, `seconds`, `tokens_per_s` (new tokens / seconds), `speedup_vs_ar` (tokens/s
  over ar's on the same prompts), `vs_best_plain` (tokens/s over the faster of the plain paths that ran, `ar` and
  `ar-compiled`: what a user compares with), `vs_llama_cpp` (over the fastest llama.cpp method's, plain or
  speculative, when one ran), `block_efficiency` (new tokens / serial calls), `serial_calls`, `mean_accepted`
  (accepted draft tokens per serial call after the first), `draft_share` (drafting time / total time), `exact` (every
  output token-identical to the reference's) and `exact_rate`.
* `exact_reference`: the method `exact` compares with: `ar`, or `ar-compiled` when it ran on a bf16/fp16 model (int8
  weights included): half precision is exact against the same dtype's compiled plain decoding, not eager `generate()`
  (other kernels round differently at near-ties).
* `samples`: one record per (prompt, turn, method): `id`, `category`, `turn`, `method`, `prompt_tokens`,
  `new_tokens`, `seconds`, `tokens_per_s`, `speedup_vs_ar` (ar's seconds / this method's), `serial_calls`,
  `block_efficiency`, `mean_accepted`, `accepted_lengths` and `draft_tokens` (per serial call), `draft_seconds`,
  `tie_checks`/`tie_changes`/`tie_seconds` (near-ties the base's eager generate() decided), `output_ids`, `exact`.
  Figures that a decoder does not report are null.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import BPDConfigError
from ..generation.stats import GenerationStats
from .decoders import (DEFAULT_METHODS, REFERENCE, BenchOptions, Decoder, MethodSkipped, default_decoders,  # noqa: F401
                       parse_methods)

PLAIN_METHODS = (REFERENCE, "ar-compiled")  # plain decoding: eager transformers generate(), hf_bpd's compiled path
OWN_KERNELS = "llama.cpp"  # methods named so compute the model another way (quantized GGUF weights): may differ from ar

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
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels' instruction set (AVX512, AVX2, ...)
        "cpu_features": cpu_feature_names(),  # what half-precision and int8 speed depends on (bf16, VNNI, AMX)
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


HALF_PRECISION_FEATURES = ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_feature_names() -> list[str]:
    """The CPU's flags among `HALF_PRECISION_FEATURES` (empty where /proc/cpuinfo has none or cannot be read)."""
    from ..runtime.int8_heads import cpu_features  # the flags the kernels are built for

    flags = set(cpu_features().split())
    return [name for name in HALF_PRECISION_FEATURES if name in flags]


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

    def tokens_per_s(method: str) -> float | None:  # over `method`'s samples; None when it has none
        mine = [s for s in samples if s["method"] == method]
        return sum(s["new_tokens"] for s in mine) / max(sum(s["seconds"] for s in mine), 1e-12) if mine else None

    ref_tps = tokens_per_s(REFERENCE)
    best_plain = max((tps for m in PLAIN_METHODS if m in methods and (tps := tokens_per_s(m)) is not None),
                     default=None)
    # llama.cpp's best: the faster of its plain and speculative methods that ran
    llama = max((tps for m in methods if m.startswith(OWN_KERNELS) and (tps := tokens_per_s(m)) is not None),
                default=None)
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
            "vs_best_plain": tps / best_plain if best_plain else None,
            "vs_llama_cpp": tps / llama if llama else None,
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

    half = getattr(model, "dtype", None) in (torch.bfloat16, torch.float16)
    checked_against = "ar-compiled" if half and "ar-compiled" in active else REFERENCE
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
            exact_reference = results.get(checked_against, reference)
            for record in results.values():
                record["exact"] = record["output_ids"] == exact_reference["output_ids"]
                record["speedup_vs_ar"] = reference["seconds"] / record["seconds"] if record["seconds"] > 0 else None
                samples.append(record)
            # later turns continue the reference's conversation, so every method sees the same prompt
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(reference["output_ids"], skip_special_tokens=True)})
    bar.close()
    samples = [s for s in samples if s["method"] not in skipped]
    ran = [m for m in methods if m not in skipped]
    if checked_against in skipped:  # it failed part way: every sample is checked against ar instead
        checked_against = REFERENCE
        outputs = {(s["id"], s["turn"]): s["output_ids"] for s in samples if s["method"] == REFERENCE}
        for s in samples:
            s["exact"] = s["output_ids"] == outputs[s["id"], s["turn"]]
    categories = sorted({s["category"] for s in samples})
    by_category = [row for c in categories
                   for row in summarize_samples([s for s in samples if s["category"] == c], ran, c)]
    return {
        "methods": ran,
        "skipped": skipped,
        "exact_reference": checked_against,
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
    llama = any(r.get("vs_llama_cpp") is not None for r in report["summary"])  # its column only when it ran
    header = ("| method | tok/s | speed-up vs ar | vs best plain | " + ("vs llama.cpp | " if llama else "")
              + "block efficiency | mean accepted | draft time | exact |\n| --- | ---: | ---: | ---: | "
              + ("---: | " if llama else "") + "---: | ---: | ---: | :---: |")

    def row(r, label):
        share = None if r["draft_share"] is None else 100 * r["draft_share"]
        exact = _fmt(r["exact"])
        if r["method"].startswith(OWN_KERNELS) and not r["exact"]:
            exact = "no (own kernels)"  # another computation of the model: equality is not promised
        elif r["method"] == REFERENCE and reference != REFERENCE and not r["exact"]:
            exact = "no (eager)"  # half precision's eager path rounds otherwise: its reference is compiled plain
        return (f"| {label} | {_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['speedup_vs_ar'])}x | "
                f"{_fmt(r.get('vs_best_plain'))}x | " + (f"{_fmt(r.get('vs_llama_cpp'))}x | " if llama else "") +
                f"{_fmt(r['block_efficiency'])} | {_fmt(r['mean_accepted'])} | "
                f"{_fmt(share, '.1f')}{'' if share is None else '%'} | {exact} |")

    reference = report.get("exact_reference", REFERENCE)
    lines = [header] + [row(r, r["method"]) for r in report["summary"]]
    if reference != REFERENCE:
        lines += ["", f"exact: the output equals {reference}'s, the same dtype's compiled plain decoding "
                      "(the reference for half precision)"]
    categories = sorted({r["category"] for r in report["by_category"]})
    if len(categories) > 1:
        lines += ["", "Per category:", "", header.replace("| method |", "| category / method |")]
        lines += [row(r, f"{r['category']} / {r['method']}") for r in report["by_category"]]
    if report["skipped"]:
        lines += ["", "Skipped:"] + [f"- `{m}`: {reason}" for m, reason in report["skipped"].items()]
    if report.get("machine"):  # every speed figure beside the CPU it came from
        lines += ["", machine_line(report["machine"])]
    return "\n".join(lines) + "\n"


def print_figures(result: dict, output=None, details=("rows",)) -> None:
    """A benchmark script's summary: `result` as JSON on stdout (without its `machine` and `details` entries), the
    machine line, and the whole of it written to `output` when given."""
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", *details)}, indent=1))
    print(machine_line(result["machine"]))
    if output:
        Path(output).write_text(json.dumps(result, indent=1))


def machine_line(machine: dict) -> str:
    """`Machine: AMD EPYC (AVX512; avx512_bf16, avx512_vnni), 2 threads, torch 2.13.0+cpu, transformers 5.24.0`."""
    features = machine.get("cpu_features")
    capability = machine.get("cpu_capability", "?") + (f"; {', '.join(features)}" if features else "")
    return (f"Machine: {machine.get('cpu')} ({capability}), {machine.get('threads')} threads, "
            f"torch {machine.get('torch')}, transformers {machine.get('transformers')}")


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
