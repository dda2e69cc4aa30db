"""Where a drafted step's time goes: wall time per serial call of each part of the decoding loop.

    python benchmarks/step_cost.py --heads 3 --limit 4            # compiled, bpd+ngram, 3 heads
    python benchmarks/step_cost.py --heads 4 --eager --rescorer none
    python benchmarks/step_cost.py --heads 4 --prompt-lookup --num-drafts 8 --draft-nodes 7   # the shipped default

Parts are timed by wrapping the library's functions for this process only (no profiler, so Python is not slowed):
drafts (all drafting: heads, lattice, rescoring, prompt lookup), of which heads / lattice / rescore; verify (the
verification call: building the block, mask and positions + the forward), of which forward (the compiled step or the
eager model call); keep (cache rollback); prefill (the prompt pass, once per call, spread over its steps); referee
(near-ties: its bookkeeping and the rare eager replays); the rest of the loop (acceptance walk, logits processors,
stopping criteria, bookkeeping) is total minus those, of which tree (building the draft tree), walk (the acceptance
walk) and accept (appending the tokens, stopping criteria). The last line is the lean-step figure: all of a step but
its forward (and the prompt pass), against the forward.
"""

import argparse
import collections
import functools
import time

import torch

import hf_bpd
from hf_bpd.evaluation.bench import first_turn_inputs
from hf_bpd.generation import drafting, verify
from hf_bpd.runtime import compiled as verify_runtime
from hf_bpd.runtime.compiled_verifier import CompiledVerifier
from hf_bpd.lattice import Lattice

TIMES = collections.defaultdict(float)


def timed(owner, name, label):
    original = getattr(owner, name)
    is_static = isinstance(owner.__dict__.get(name), (classmethod, staticmethod))

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - start

    setattr(owner, name, classmethod(lambda cls, *a, **k: wrapper(*a, **k)) if is_static else wrapper)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd")
    p.add_argument("--questions", default="benchmarks/bench_prompts.jsonl")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--rescorer", default="ngram")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--prompt-lookup", action="store_true")
    p.add_argument("--schedule", default="fixed")
    p.add_argument("--num-drafts", type=int, default=1)
    p.add_argument("--draft-nodes", type=int, default=None)
    p.add_argument("--fp32-heads", action="store_true", help="heads_int8=False: the heads' own fp32 weights")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the base's dtype")
    p.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights (hf_bpd.Int8WeightsConfig, bf16)")
    args = p.parse_args()
    torch.set_num_threads(2)
    load = {}
    if args.dtype == "bf16" or args.quantize:
        load["dtype"] = torch.bfloat16
    if args.quantize:
        load["quantization_config"] = hf_bpd.Int8WeightsConfig()
    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.model, **load)
    inputs = first_turn_inputs(hf_bpd.load_tokenizer(args.model), args.questions, args.limit)
    options = dict(rescorer=None if args.rescorer == "none" else args.rescorer, compile=not args.eager,
                   num_heads_to_use=args.heads, prompt_lookup=args.prompt_lookup, draft_schedule=args.schedule,
                   num_drafts=args.num_drafts, draft_nodes=args.draft_nodes, tree=None,
                   heads_int8=False if args.fp32_heads else None)
    model.generate(**inputs[0], max_new_tokens=8, **options)  # warm-up / compile
    plain = dict(use_heads=False, compile=not args.eager)
    if not args.eager:
        model.generate(**inputs[0], max_new_tokens=8, **plain)
    timed(drafting.BlockDrafter, "drafts", "drafts")
    timed(model.heads.__class__, "step_logits", "heads")
    timed(Lattice, "from_head_logits", "lattice")
    rescorer = model.bundled_rescorers.get(args.rescorer) if args.rescorer != "none" else None
    if rescorer is not None:
        timed(type(rescorer), "rescore", "rescore")
    verifier = verify.EagerVerifier if args.eager else CompiledVerifier
    timed(verifier, "verify", "verify")
    timed(verifier, "keep", "keep")
    timed(verifier, "prefill", "prefill")
    from hf_bpd.generation import near_ties
    timed(near_ties.EagerReferee, "settle", "referee")
    from hf_bpd.generation import decoding, stopping
    timed(decoding, "walk_greedy", "walk")
    timed(decoding, "walk", "walk")
    timed(decoding, "DraftTree", "tree")
    timed(stopping.DecodedSequence, "accept", "accept")
    timed(drafting, "prompt_lookup", "lookup")
    timed(drafting, "best_first_nodes", "nodes")
    timed(Lattice, "token_probs", "probs")
    if not args.eager:
        timed(verify_runtime.CompiledRunner, "run", "forward")
        runner = next(iter(verify_runtime._RUNNERS[model.base_lm].values()))
        from hf_bpd.runtime import int8_heads
        timed(int8_heads.Int8HeadsStep, "__call__", "heads")  # the int8 heads step (heads_int8)
        for by_width in runner.heads_steps.values():  # the compiled heads step(s): wrap each in place
            for width, step in list(by_width.items()):
                def heads_timed(hidden, token, _step=step):
                    start = time.perf_counter()
                    try:
                        return _step(hidden, token)
                    finally:
                        TIMES["heads"] += time.perf_counter() - start
                by_width[width] = heads_timed
    calls = tokens = 0
    total = 0.0
    for inp in inputs:
        start = time.perf_counter()
        model.generate(**inp, max_new_tokens=args.max_new_tokens, **options)
        total += time.perf_counter() - start
        calls += model.last_generation_stats.serial_calls
        tokens += model.last_generation_stats.new_tokens
    parts = dict(TIMES)
    TIMES.clear()
    plain_total = plain_calls = 0
    for inp in inputs:
        start = time.perf_counter()
        model.generate(**inp, max_new_tokens=args.max_new_tokens, **plain)
        plain_total += time.perf_counter() - start
        plain_calls += model.last_generation_stats.serial_calls if not args.eager else \
            model.last_generation_stats.new_tokens
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {args.heads} heads, rescorer {args.rescorer}, "
          f"{'eager' if args.eager else 'compiled'}, lookup {args.prompt_lookup}, schedule {args.schedule}, "
          f"heads {'fp32' if args.fp32_heads else 'int8 where it can'}, base {args.quantize or args.dtype}")
    print(f"block efficiency {tokens / calls:.2f}; {1000 * total / calls:.1f} ms per drafted serial call; plain "
          f"{1000 * plain_total / plain_calls:.1f} ms per call; speed vs plain "
          f"{tokens / total / (plain_calls / plain_total):.2f}x")
    rest = total - sum(parts.get(name, 0) for name in ("drafts", "verify", "keep", "prefill", "referee"))
    parts["rest"] = rest
    layout = [("drafts", 0), ("heads", 1), ("lattice", 1), ("probs", 1), ("rescore", 1), ("lookup", 1), ("nodes", 1),
              ("verify", 0), ("forward", 1), ("keep", 0), ("prefill", 0), ("referee", 0), ("rest", 0), ("tree", 1),
              ("walk", 1), ("accept", 1)]
    for name, depth in layout:
        if name in parts:
            print(f"  {'  ' * depth}{name:8s} {1000 * parts[name] / calls:6.2f} ms/call")
    if "forward" in parts:  # the lean-step figure: everything a step does besides the forward (the prompt pass apart)
        overhead = total - parts["forward"] - parts.get("prefill", 0)
        print(f"drafting + bookkeeping {1000 * overhead / calls:.2f} ms/call = "
              f"{100 * overhead / parts['forward']:.1f} % of the verification forward")

if __name__ == "__main__":
    main()
