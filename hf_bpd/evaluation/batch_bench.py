"""`hf-bpd bench --batch-size`: batched drafting against transformers' batched plain greedy `generate()` on the same
left-padded batches, per batch size."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .bench import _fmt, encode_messages, machine_line
from .decoders import MethodSkipped, base_of




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
    if report.get("machine"):
        lines += ["", machine_line(report["machine"])]
    return "\n".join(lines) + "\n"
