"""How many draft nodes a compiled chain with prompt lookup should verify per step: the shipped default with
`verify_runtime.COMPILED_DRAFT_SLOTS` set to each value given, alternating per prompt with compiled plain decoding in one
process (every step compiled in an uncounted warm-up); tok/s, ratios, block efficiency, identical outputs.

    python benchmarks/draft_slots.py --slots 3,7 --questions benchmarks/dev_prompts.jsonl --max-new-tokens 256
"""

import argparse
import json
import time

import torch

import hf_bpd
from hf_bpd.evaluation.bench import first_turn_inputs
from hf_bpd.runtime import compiled as verify_runtime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd")
    p.add_argument("--questions", default="benchmarks/dev_prompts.jsonl")
    p.add_argument("--slots", default="3,7", help="values of COMPILED_DRAFT_SLOTS, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.model)
    inputs = first_turn_inputs(hf_bpd.load_tokenizer(args.model), args.questions, args.limit)
    slots = [int(x) for x in args.slots.split(",")]
    plans = {"ar-compiled": (None, dict(use_heads=False, compile=True))}
    plans.update({f"default, {s} slots": (s, {}) for s in slots})
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    library_value = verify_runtime.COMPILED_DRAFT_SLOTS
    for value, options in plans.values():  # warm-up: compile every block length outside the timed region
        if value is not None:
            verify_runtime.COMPILED_DRAFT_SLOTS = value
        model.generate(**inputs[0], max_new_tokens=8, do_sample=False, **options)
    totals = {name: {"seconds": 0.0, "tokens": 0, "calls": 0, "outputs": []} for name in plans}
    for x in inputs:
        for name, (value, options) in plans.items():
            if value is not None:
                verify_runtime.COMPILED_DRAFT_SLOTS = value
            start = time.perf_counter()
            out = model.generate(**x, **greedy, **options)
            totals[name]["seconds"] += time.perf_counter() - start
            new = out[0, x["input_ids"].shape[1]:].tolist()
            totals[name]["tokens"] += len(new)
            totals[name]["calls"] += model.last_generation_stats.serial_calls
            totals[name]["outputs"].append(new)
    verify_runtime.COMPILED_DRAFT_SLOTS = library_value  # what the library uses again
    reference = totals["ar-compiled"]
    rows = []
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, {len(inputs)} prompts")
    print("| plan | tok/s | vs compiled plain | block efficiency | ms per step | identical |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, t in totals.items():
        speed = t["tokens"] / t["seconds"]
        row = dict(plan=name, tokens_per_s=speed, vs_compiled_plain=speed / (reference["tokens"] / reference["seconds"]),
                   block_efficiency=t["tokens"] / t["calls"], ms_per_step=1000 * t["seconds"] / t["calls"],
                   identical=sum(a == b for a, b in zip(t["outputs"], reference["outputs"])))
        rows.append(row)
        print(f"| {name} | {speed:.1f} | {row['vs_compiled_plain']:.2f}x | {row['block_efficiency']:.2f} | "
              f"{row['ms_per_step']:.1f} | {row['identical']} / {len(inputs)} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"rows": rows, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "threads": args.threads, "max_new_tokens": args.max_new_tokens,
                       "questions": args.questions}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
