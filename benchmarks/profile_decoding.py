"""Where decoding time goes: cProfile over `generate()` on held-out prompts, grouped into the parts of a BPD step.

    python benchmarks/profile_decoding.py --model checkpoints/smollm2-135m-instruct-bpd --limit 4 \
        --max-new-tokens 128 --methods bpd,bpd+ngram,tree

Parts (cumulative time of the named functions, made exclusive by subtracting nested parts):
  verification forward  the base model's forward passes (prompt pass included)
  heads                 the drafting heads on the last hidden state (top-k lattice included)
  rescoring             `Rescorer.rescore` (n-gram DP / neural LM)
  tree masks            building the 4D tree attention masks and trie (p-best, tree)
  cache bookkeeping     `DynamicCache.crop` / reordering the accepted path's cache entries
  loop overhead         everything else inside `generate()`: transformers' assisted loop, logits processors,
                        stopping criteria, tensor glue (Python)
The profiler slows Python-heavy parts more than torch kernels, so the table also gives the unprofiled wall time.
"""

import argparse
import cProfile
import inspect
import json
import pstats
import sys
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.evaluation.bench import first_turn_inputs

METHODS = {
    "bpd": dict(rescorer=None, num_drafts=1, tree=None, draft_nodes=None),
    "bpd+ngram": dict(rescorer="ngram", num_drafts=1, tree=None, draft_nodes=None),
    "bpd+neural": dict(rescorer="neural", num_drafts=1, tree=None, draft_nodes=None),
    "pbest-ngram": dict(rescorer="ngram", num_drafts=4, tree=None),
    "tree": dict(rescorer=None, num_drafts=1, tree=(4, 2, 2, 1)),  # widths, cut to the model's heads
}
# (part, predicate on a pstats key (file, line, function name)); earlier parts are nested inside later ones
PARTS = [
    ("rescoring", lambda f, n: n == "rescore" and "rescorers" in f),
    ("heads", lambda f, n: (n == "step_logits" and f.endswith("heads.py")) or
     (n == "from_head_logits" and f.endswith("lattice.py"))),
    ("tree masks", lambda f, n: f.endswith("tree.py") and n in ("tree_attention_masks", "__init__")),
    ("cache bookkeeping", lambda f, n: (f.endswith("tree.py") and n == "keep_accepted") or
     (f.endswith("cache_utils.py") and n == "crop")),
]


def cumulative(stats: pstats.Stats, predicate) -> float:
    """Cumulative seconds of the functions matching `predicate`, not double-counting recursive entries."""
    return sum(entry[3] for (f, _, n), entry in stats.stats.items() if predicate(f, n))


def profile_method(model, prompts, options, max_new_tokens):
    # the model class's own forward (transformers wraps it in decorators whose shared wrapper code would also match
    # every decorated submodule)
    code = inspect.unwrap(type(model.base_lm).forward).__code__
    profiler = cProfile.Profile()
    tokens, wall = 0, 0.0
    for inputs in prompts:  # unprofiled timing first
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
        wall += time.perf_counter() - start
        tokens += out.shape[1] - inputs["input_ids"].shape[1]
    serial = new = 0
    for inputs in prompts:
        profiler.enable()
        model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
        profiler.disable()
        serial += model.last_generation_stats.serial_calls
        new += model.last_generation_stats.new_tokens
    block_efficiency = new / serial
    stats = pstats.Stats(profiler)
    total = cumulative(stats, lambda f, n: n == "generate" and f.endswith("modeling.py") and "hf_bpd" in f)
    key = (code.co_filename, code.co_firstlineno, code.co_name)
    parts = {"verification forward": stats.stats[key][3] if key in stats.stats else 0.0}
    for name, predicate in PARTS:
        parts[name] = cumulative(stats, predicate)
    parts["loop overhead"] = max(0.0, total - sum(parts.values()))
    return {"tokens_per_s": tokens / wall, "block_efficiency": block_efficiency, "profiled_seconds": total,
            "share": {k: v / total for k, v in parts.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd")
    p.add_argument("--questions", default="benchmarks/dev_prompts.jsonl")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="bpd,bpd+ngram,tree")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="write the table as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.model)
    prompts = first_turn_inputs(hf_bpd.load_tokenizer(args.model), args.questions, args.limit)
    model.generate(**prompts[0], max_new_tokens=8, do_sample=False)  # warm-up
    rows = {}
    for method in args.methods.split(","):
        rows[method] = profile_method(model, prompts, METHODS[method], args.max_new_tokens)
    parts = list(next(iter(rows.values()))["share"])
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.threads} threads; share of generate() time")
    print("| method | tok/s | block eff. | " + " | ".join(parts) + " |")
    print("| --- " * (len(parts) + 3) + "|")
    for method, r in rows.items():
        print(f"| {method} | {r['tokens_per_s']:.1f} | {r['block_efficiency']:.2f} | "
              + " | ".join(f"{100 * r['share'][k]:.0f} %" for k in parts) + " |")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
