"""Near-ties: how far the fast paths' logits are from the eager greedy `generate()`'s, and whether the default output
equals it once near-ties are left to the referee (`hf_bpd.generation.near_ties`).

    # rounding: compiled BPD and compiled plain decoding (tie_margin=0) vs eager generate(), logits position by position
    python benchmarks/near_ties.py --model checkpoints/smollm2-135m-instruct-bpd \
        --questions benchmarks/exactness_prompts.jsonl --rounding 8 --output benchmarks/results/near_ties_rounding.json
    # exactness: the checkpoint's default generate() (referee on) vs stored eager greedy outputs of every prompt
    python benchmarks/near_ties.py --model checkpoints/smollm2-135m-instruct-bpd \
        --questions benchmarks/exactness_prompts.jsonl --exclude benchmarks/dev_prompts.jsonl \
        --references benchmarks/results/bench_exactness_default.json \
        --output benchmarks/results/near_ties_exactness.json

Margins and errors are relative: `(top1 - top2) / max(1, |top1|)` of the eager logits, and the largest
`|fast - eager|` over the vocabulary divided by the same scale. References (`--references`) are the `ar` outputs of an
`hf-bpd bench` JSON (eager greedy `generate()`, same prompts, chat template, 256 new tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.evaluation.bench import encode_messages, load_questions, machine_info


def rounding(model, tokenizer, questions, max_new_tokens: int) -> dict:
    """Per prompt, along the eager reference (until a path leaves it): the largest relative logit difference of
    compiled BPD and compiled plain decoding (no referee), and the eager margins."""
    rows, margins = [], []
    for q in questions:
        inputs = encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], None)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            ref = model.base_lm.generate(**inputs, **kwargs)
        row = {"id": q["id"]}
        for name, options in {"default": {}, "plain-compiled": {"use_heads": False, "compile": True}}.items():
            out = model.generate(**inputs, **kwargs, **options, tie_margin=0)
            worst, left = 0.0, None
            for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
                scale = max(1.0, abs(float(b.max())))
                worst = max(worst, float((a.float() - b.float()).abs().max()) / scale)
                if int(out.sequences[0, inputs["input_ids"].shape[1] + step]) != \
                        int(ref.sequences[0, inputs["input_ids"].shape[1] + step]):
                    top = b[0].float().topk(2).values
                    left = {"step": step, "margin": float(top[0] - top[1]) / scale}
                    break
            row[name] = {"max_rel_error": worst, "left_reference_at": left}
        for b in ref.logits:
            top = b[0].float().topk(2).values
            margins.append(float(top[0] - top[1]) / max(1.0, abs(float(top[0]))))
        rows.append(row)
        print(json.dumps(row), flush=True)
    margins.sort()
    below = {f"{t:g}": sum(m < t for m in margins) for t in (1e-7, 1e-6, 1e-5, 3e-5, 1e-4, 1e-3)}
    return {"prompts": rows, "positions": len(margins), "positions_with_margin_below": below,
            "max_rel_error": {name: max(r[name]["max_rel_error"] for r in rows) for name in ("default",
                                                                                         "plain-compiled")}}


def exactness(model, tokenizer, questions, max_new_tokens: int, reference_file: Path, **options) -> dict:
    """The checkpoint's default `generate()` (referee on; `options`: e.g. `drafter="feature"`) against stored eager
    outputs."""
    bench = json.loads(reference_file.read_text())
    refs = {s["id"]: s["output_ids"] for s in bench["samples"] if s["method"] == "ar"}
    rows, total = [], {"prompts": 0, "identical": 0, "new_tokens": 0, "seconds": 0.0, "tie_checks": 0,
                       "tie_changes": 0, "tie_seconds": 0.0}
    for q in questions:
        if q["id"] not in refs:
            continue
        inputs = encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], None)
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
        seconds = time.perf_counter() - start
        stats = model.last_generation_stats
        got = out[0, inputs["input_ids"].shape[1]:].tolist()
        same = got == refs[q["id"]]
        row = {}
        if not same:  # check the stored reference against this machine's own eager generate()
            with torch.no_grad():
                now = model.base_lm.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            now = now[0, inputs["input_ids"].shape[1]:].tolist()
            row = {"stored_reference_reproduced": now == refs[q["id"]], "identical_to_eager_now": got == now}
        row = {"id": q["id"], "identical": same, "new_tokens": len(got), "seconds": seconds, **row,
               "block_efficiency": stats.block_efficiency, "tie_checks": stats.tie_checks,
               "tie_changes": stats.tie_changes, "tie_seconds": stats.tie_seconds}
        rows.append(row)
        total["prompts"] += 1
        total["identical"] += same
        for key in ("new_tokens", "seconds", "tie_checks", "tie_changes", "tie_seconds"):
            total[key] += row[key]
        print(json.dumps(row), flush=True)
    total["tie_share_of_time"] = total["tie_seconds"] / total["seconds"] if total["seconds"] else 0.0
    return {"total": total, "prompts": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd")
    p.add_argument("--questions", default="benchmarks/exactness_prompts.jsonl")
    p.add_argument("--exclude", default=None, help="a prompt file whose prompts (by id) are skipped")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rounding", type=int, default=0, metavar="N",
                   help="compare logits on the first N prompts (compiled paths without the referee vs eager)")
    p.add_argument("--references", type=Path, default=None,
                   help="an hf-bpd bench JSON whose ar outputs are the eager references (exactness run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--drafter", choices=["heads", "feature"], default="heads",
                   help="what drafts in the exactness check (feature: the checkpoint's feature-level drafter)")
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.model)
    tokenizer = hf_bpd.load_tokenizer(args.model)
    skip = {q["id"] for q in load_questions(args.exclude)} if args.exclude else set()
    questions = [q for q in load_questions(args.questions) if q["id"] not in skip][: args.limit]
    inputs = encode_messages(tokenizer, [{"role": "user", "content": "Hi"}], None)
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=8, do_sample=False, compile="wait")  # compile outside what is measured
    model.generate(**inputs, max_new_tokens=8, do_sample=False, compile="wait", drafter=args.drafter)
    model.generate(**inputs, max_new_tokens=8, do_sample=False, use_heads=False, compile=True)
    result = {"model": args.model, "questions": args.questions, "excluded": args.exclude,
              "prompts": len(questions), "max_new_tokens": args.max_new_tokens, "drafter": args.drafter,
              "machine": machine_info(), "warm_up_seconds": time.perf_counter() - start}
    if args.rounding:
        result["rounding"] = rounding(model, tokenizer, questions[: args.rounding], args.max_new_tokens)
    if args.references is not None:
        result["exactness"] = exactness(model, tokenizer, questions, args.max_new_tokens, args.references,
                                        drafter=args.drafter)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.get("rounding", {}).items() if k != "prompts"}))
    if "exactness" in result:
        print(json.dumps(result["exactness"]["total"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
