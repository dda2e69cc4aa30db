"""Long runs: memory stays flat and the output stays exact over thousands of new tokens, with every rescorer.

Generates `--max-new-tokens` tokens (EOS ignored, so every run is that long) from one prompt, first with the base's
plain greedy `generate()` (the reference), then with the heads and each rescorer (`none`: the heads' own scores, then
every rescorer the checkpoint bundles). While each run decodes, a streamer samples the process's resident memory
every `--sample-every` tokens; the table reports, per run, the RSS before it, at half way and at the end, the peak,
the growth over the second half (flat: a few MB, whatever the length), and whether the output is token-identical to
the reference.

    python benchmarks/long_run.py                               # shipped checkpoint, 4,096 tokens (~10+ min, 2 cores)
    python benchmarks/long_run.py --max-new-tokens 256          # a quick check
    python benchmarks/long_run.py --model DIR --json out.json   # any heads checkpoint; figures as JSON too
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time

import psutil
import torch
from transformers.generation.streamers import BaseStreamer

import hf_bpd

PROMPT = ("Write a detailed, step-by-step guide to planning a two-week trip through Japan: transport, lodging, food, "
          "customs, budget and a day-by-day itinerary.")


class MemoryProbe(BaseStreamer):
    """A streamer that records (tokens so far, RSS in MB) every `every` new tokens, and a thread that keeps the
    peak RSS between samples."""

    def __init__(self, prompt_length: int, every: int):
        self.process = psutil.Process(os.getpid())
        self.prompt_length, self.every = prompt_length, every
        self.tokens, self.samples, self.peak = -prompt_length, [], 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def rss(self) -> float:
        value = self.process.memory_info().rss / 2**20
        self.peak = max(self.peak, value)
        return value

    def _watch(self):
        while not self._stop.wait(0.05):
            self.rss()

    def __enter__(self):
        self.samples.append((0, self.rss()))
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def put(self, value):
        before = self.tokens
        self.tokens += value.numel()
        if self.tokens > 0 and before // self.every != self.tokens // self.every:
            self.samples.append((self.tokens, self.rss()))

    def end(self):
        self.samples.append((max(self.tokens, 0), self.rss()))


def rss_at(samples, tokens: int) -> float:
    """The first sample at or after `tokens` new tokens."""
    return next((rss for n, rss in samples if n >= tokens), samples[-1][1])


def run(model, inputs, max_new_tokens: int, every: int, **options) -> dict:
    """One long generation with `model.generate(**options)` (a `BlockwiseParallelForCausalLM`, or the base itself
    for the reference), with its memory figures."""
    gc.collect()
    with MemoryProbe(inputs["input_ids"].shape[1], every) as probe:
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             streamer=probe, **options)
        seconds = time.perf_counter() - start
    new = out.shape[1] - inputs["input_ids"].shape[1]
    half, end = rss_at(probe.samples, new // 2), probe.samples[-1][1]
    stats = getattr(model, "last_generation_stats", None)
    return {"output": out, "new_tokens": new, "seconds": seconds,
            "block_efficiency": stats.block_efficiency if stats is not None else 1.0,
            "rss_start_mb": probe.samples[0][1], "rss_half_mb": half, "rss_end_mb": end, "peak_rss_mb": probe.peak,
            "second_half_growth_mb": end - half, "samples": probe.samples}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd", help="heads checkpoint directory")
    parser.add_argument("--max-new-tokens", type=int, default=4096, help="tokens per run (EOS is ignored)")
    parser.add_argument("--rescorers", default=None,
                        help="comma-separated: none and/or bundled rescorer names (default: none + every bundled one)")
    parser.add_argument("--compile", action="store_true", help="compiled verification (default: eager)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--sample-every", type=int, default=64, help="record the RSS every N new tokens")
    parser.add_argument("--max-growth-mb", type=float, default=64.0,
                        help="fail (exit 1) when a run's RSS grows more than this over its second half, beyond what "
                             "its KV cache itself grows (the plain run's cache grows as much)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2 or args.sample_every < 1 or args.threads < 1:
        parser.error("--max-new-tokens must be >= 2, --sample-every and --threads >= 1")

    torch.set_num_threads(args.threads)
    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.model)
    tokenizer = hf_bpd.load_tokenizer(args.model)
    if tokenizer.chat_template:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    else:
        inputs = tokenizer(PROMPT, return_tensors="pt")
    names = args.rescorers.split(",") if args.rescorers else ["none", *sorted(model.bundled_rescorers)]
    common = dict(compile=args.compile, num_drafts=1, tree=None, draft_top_k=None, draft_nodes=None)

    def log(name, row):
        print(f"long_run: {name}: {row['new_tokens']} tokens in {row['seconds']:.1f} s, peak RSS "
              f"{row['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)

    rows = {"plain": run(model.base_lm, inputs, args.max_new_tokens, args.sample_every)}  # the base's generate()
    log("plain", rows["plain"])
    reference = rows["plain"]["output"]
    for name in names:
        rows[name] = run(model, inputs, args.max_new_tokens, args.sample_every, rescorer=name, **common)
        log(name, rows[name])
    failed = False
    config = model.base_lm.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_mb = (config.num_hidden_layers * 2 * kv_heads * head_dim * model.base_lm.dtype.itemsize
             * (args.max_new_tokens - args.max_new_tokens // 2) / 2**20)  # the KV cache's own second-half growth
    print(f"{args.max_new_tokens} new tokens, prompt of {inputs['input_ids'].shape[1]} tokens, "
          f"{'compiled' if args.compile else 'eager'}, {args.threads} threads; process peak RSS "
          f"{psutil.Process().memory_info().rss / 2**20:.0f} MB now; the KV cache grows {kv_mb:.0f} MB over a "
          "second half")
    print("| run | new tokens | s | tok/s | block efficiency | RSS start MB | RSS half MB | RSS end MB | peak RSS MB "
          "| 2nd-half growth MB | beyond the KV cache MB | exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        row["exact"] = bool(torch.equal(row["output"], reference))
        row["growth_beyond_kv_mb"] = row["second_half_growth_mb"] - kv_mb
        flat = row["growth_beyond_kv_mb"] <= args.max_growth_mb
        failed |= not (row["exact"] and flat and row["new_tokens"] == args.max_new_tokens)
        print(f"| {name if name == 'plain' else 'bpd + ' + name} | {row['new_tokens']} | {row['seconds']:.1f} | "
              f"{row['new_tokens'] / row['seconds']:.1f} | {row['block_efficiency']:.2f} | {row['rss_start_mb']:.0f} | "
              f"{row['rss_half_mb']:.0f} | {row['rss_end_mb']:.0f} | {row['peak_rss_mb']:.0f} | "
              f"{row['second_half_growth_mb']:+.1f} | {row['growth_beyond_kv_mb']:+.1f} | "
              f"{'yes' if row['exact'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args),
                       "runs": {n: {k: v for k, v in r.items() if k != "output"} for n, r in rows.items()}}, f,
                      indent=1)
    print("OK: exact and flat" if not failed else "FAILED: see the table", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
