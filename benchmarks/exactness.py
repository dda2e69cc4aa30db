"""Exactness of a half-precision or int8-weight base: the compiled default against the same base's compiled plain
decoding, token for token, on every prompt of a file (the eager `generate()` of such a base is another computation,
so it is not the reference: docs/reliability.md).

    python benchmarks/exactness.py --model checkpoints/smollm2-135m-instruct-bpd \
        --questions benchmarks/exactness_prompts.jsonl --dtype bf16 --output bf16.json
    python benchmarks/exactness.py --model checkpoints/smollm2-135m-instruct-bpd \
        --questions benchmarks/exactness_prompts.jsonl --quantize int8 --output int8.json

Each prompt (its first turn, in the chat template) decodes with `use_heads=False, compile="wait"` and then with the
checkpoint's defaults and `compile="wait"`; both are timed (compilation is in an untimed first prompt), so the output
also gives both speeds, which are speed figures only when nothing else ran on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_bpd.cli.common import load_for_generation
from hf_bpd.evaluation.bench import encode_messages, load_questions, machine_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--questions", required=True)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights (bf16 activations)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype]
    model, tokenizer = load_for_generation(args.model, dtype, "cpu", args.quantize)
    questions = load_questions(args.questions)[: args.limit]

    def encoded(question):
        return encode_messages(tokenizer, [{"role": "user", "content": question["turns"][0]}])

    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, compile="wait")
    model.generate(**encoded(questions[0]), use_heads=False, **settings)  # compiles, untimed
    model.generate(**encoded(questions[0]), **settings)
    rows, plain_seconds, default_seconds = [], 0.0, 0.0
    for question in questions:
        inputs = encoded(question)
        start = time.perf_counter()
        plain = model.generate(**inputs, use_heads=False, **settings)
        plain_seconds += time.perf_counter() - start
        start = time.perf_counter()
        default = model.generate(**inputs, **settings)
        default_seconds += time.perf_counter() - start
        stats = model.last_generation_stats
        rows.append({"id": question["id"], "identical": torch.equal(plain, default),
                     "new_tokens": plain.shape[1] - inputs["input_ids"].shape[1],
                     "block_efficiency": round(stats.block_efficiency, 3), "verifier": stats.verifier})
    tokens = sum(row["new_tokens"] for row in rows)
    summary = {"model": args.model, "questions": args.questions, "dtype": str(model.dtype), "quantize": args.quantize,
               "max_new_tokens": args.max_new_tokens, "prompts": len(rows),
               "identical": sum(row["identical"] for row in rows), "new_tokens": tokens,
               "plain_tok_s": round(tokens / plain_seconds, 1), "default_tok_s": round(tokens / default_seconds, 1),
               "block_efficiency": round(sum(r["block_efficiency"] for r in rows) / len(rows), 3)}
    print(json.dumps(summary))
    Path(args.output).write_text(json.dumps({"summary": summary, "machine": machine_info(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
