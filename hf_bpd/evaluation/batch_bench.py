"""`hf-bpd bench --batch-size`: batched drafting (eager and compiled) against batched plain greedy decoding
(transformers' `generate()` and hf_bpd's compiled plain steps) on the same left-padded batches, per batch size."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .bench import _fmt, encode_messages, machine_line
from .decoders import MethodSkipped, base_of

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


BATCH_METHODS = ("ar", "ar-compiled", "ar-artifact", "bpd", "bpd-compiled")  # `--batch-size` unless `--methods`
PLAIN_METHODS = ("ar", "ar-compiled", "ar-artifact")


def batch_decoders(model, base, settings: dict, methods) -> dict:
    """Batched decoding by name: `ar` transformers' batched plain `generate()`; `ar-compiled` hf_bpd's compiled plain
    steps (`use_heads=False, compile="wait"`); `ar-artifact` hf_bpd's plain steps on the base's artifact
    (`use_heads=False, compile=True`: what turning the heads off gives by default); `bpd` the default,
    `compile=True`: batched drafting verified on the base's artifact (`hf_bpd.runtime.artifacts`, built here first
    when missing, outside every timed call), eagerly where it cannot serve the base; `bpd-compiled` batched drafting
    on the compiled batched step (`compile="wait"`: the shapes a batch meets compile in the call, and their time is
    taken out of the timing; the two compiled methods share their shapes, so a shape's time is the first one's)."""
    check_batch_methods(methods)
    if "bpd" in methods or "ar-artifact" in methods:
        build_batch_artifacts(base)
    known = {"ar": lambda batch: base.generate(**batch, **settings),
             "ar-compiled": lambda batch: model.generate(**batch, **settings, use_heads=False, compile="wait"),
             "ar-artifact": lambda batch: model.generate(**batch, **settings, use_heads=False, compile=True),
             "bpd": lambda batch: model.generate(**batch, **settings, compile=True),
             "bpd-compiled": lambda batch: model.generate(**batch, **settings, compile="wait")}
    return {m: known[m] for m in methods}


def build_batch_artifacts(base) -> bool:
    """Build (when missing) and load `base`'s artifact and its batch steps when it can verify its batches (what
    `compile=True` would otherwise start in the background); True when batches of `base` run on them."""
    from ..runtime import artifacts
    from ..runtime.batched import batched_artifact_unsupported_reason

    if batched_artifact_unsupported_reason(base, 1) is not None:
        return False
    artifacts.ensure(base)
    if artifacts.one_token_unsupported_reason(base) is None:  # sliding-window bases: their batches never load it
        for graph in artifacts.BATCH_GRAPHS:
            artifacts.ensure(base, graph=graph)
    return True


def check_batch_methods(methods) -> None:
    """A one-line error for batch method names that `batch_decoders` does not know (or none at all)."""
    unknown = [m for m in methods if m not in BATCH_METHODS]
    if unknown or not methods:
        raise ValueError(f"batch methods are {', '.join(BATCH_METHODS)}, got {', '.join(unknown) or 'none'}")


def run_batch_bench(model, tokenizer, questions: Sequence[dict], batch_sizes: Sequence[int],
                    max_new_tokens: int = 128, chat: bool | None = None, warmup: int = 1, progress: bool = True,
                    log=None, methods: Sequence[str] = BATCH_METHODS, rounds: int = 1) -> dict:
    """Batched decoding methods (`batch_decoders`) on the same left-padded batches of consecutive prompts, in an
    order that rotates per call; per batch size and method: tokens/s (compilation taken out), the ratio to the best
    plain method, the rows' pooled block efficiency and how many rows are token-identical to the reference (before
    the timed calls, `warmup` uncounted rounds of every method decoding the first batch in full; compilation left
    in a timed call is subtracted from it; `rounds` timed passes over the batches, the rotation going on from pass
    to pass, so that the machine's drift spreads over the methods; a row counts as identical when it was in every
    round):
    transformers' batched plain decoding (`ar`) for fp32 bases, hf_bpd's compiled plain steps (`ar-compiled`: each row
    its prompt's lone compiled plain output) for half-precision ones, else the first method run."""
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
    decoders = batch_decoders(model, base, settings, list(methods))
    names = list(decoders)
    exact_to = "ar" if base.dtype in (torch.float32, torch.float64) else "ar-compiled"
    reference = exact_to if exact_to in names else names[0]
    results = []
    for size in batch_sizes:
        batches = [left_pad(prompts[i: i + size], pad_id, model.device) for i in range(0, len(prompts), size)]
        for _ in range(max(warmup, 0)):  # the first batch in full: the widths and smaller runners its steps
            for decode in decoders.values():  # choose compile here, not in the timed calls
                decode(batches[0])
        seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        calls, passes, compiling = dict.fromkeys(names, 0), dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
        identical = {name: [True] * len(prompts) for name in names}  # per prompt: in every round
        timed_calls = [(i, batch) for _ in range(rounds) for i, batch in enumerate(batches)]
        for call, (i, batch) in enumerate(tqdm(timed_calls, desc=f"batch {size}", disable=not progress)):
            outputs = {}
            for name in names[call % len(names):] + names[: call % len(names)]:
                start = time.perf_counter()
                out = decoders[name](batch)
                seconds[name] += time.perf_counter() - start
                outputs[name] = _new_tokens(out, batch["input_ids"].shape[1], eos_ids)
                tokens[name] += sum(len(r) for r in outputs[name])
                if name != "ar":
                    stats = model.last_generation_stats
                    compiling[name] += stats.compile_seconds or 0.0
                    rows_stats = stats.rows or [stats]
                    calls[name] += sum(r.serial_calls for r in rows_stats)
                    passes[name] += stats.forward_passes or stats.serial_calls
            for name in names:
                for j, (a, b) in enumerate(zip(outputs[reference], outputs[name])):
                    identical[name][i * size + j] &= a == b
        rows = len(prompts)
        per_method = {}
        for name in names:
            timed = seconds[name] - compiling[name]
            per_method[name] = {"tokens_per_s": tokens[name] / timed, "seconds": timed,
                                "compile_seconds": compiling[name], "identical_rows": sum(identical[name]),
                                "block_efficiency": tokens[name] / calls[name] if calls[name] else None,
                                "forward_passes": passes[name] // rounds or None}
        plain = [m for m in names if m in PLAIN_METHODS]
        best = max(plain, key=lambda m: per_method[m]["tokens_per_s"]) if plain else None
        for name in names:
            per_method[name]["vs_best_plain"] = per_method[name]["tokens_per_s"] / \
                per_method[best]["tokens_per_s"] if best else None
        result = {"batch_size": size, "prompts": rows, "rounds": rounds, "reference": reference, "best_plain": best,
                  "methods": per_method}
        log(f"batch {size}: " + ", ".join(
            f"{m} {r['tokens_per_s']:.1f} tok/s" + (f" ({r['vs_best_plain']:.2f}x)" if best else "") +
            (f" BE {r['block_efficiency']:.2f}" if r["block_efficiency"] else "") +
            f" {r['identical_rows']}/{rows}" for m, r in per_method.items()))
        results.append(result)
    return {"batches": results}


def markdown_batch_report(report: dict) -> str:
    lines = ["| batch size | method | tok/s | vs best plain | block efficiency | identical rows | compiling (s) |",
             "| ---: | --- | ---: | ---: | ---: | :---: | ---: |"]
    for r in report["batches"]:
        for name, m in r["methods"].items():
            ratio = f"{m['vs_best_plain']:.2f}x" if m["vs_best_plain"] is not None else "-"
            lines.append(f"| {r['batch_size']} | {name} | {m['tokens_per_s']:.1f} | {ratio} | "
                         f"{_fmt(m['block_efficiency'])} | {m['identical_rows']}/{r['prompts']} | "
                         f"{m['compile_seconds']:.0f} |")
    if report.get("machine"):
        lines += ["", machine_line(report["machine"])]
    return "\n".join(lines) + "\n"
