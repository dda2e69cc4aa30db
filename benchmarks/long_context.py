"""A conversation that grows: the dev prompts asked one after another in one chat, each turn's context holding every
earlier turn, until the context passes `--max-context` tokens. Per turn, compiled plain decoding (`use_heads=False,
compile=True`) and the checkpoint's default, in one process, alternating which runs first: tok/s, the longest gap
between two streamed pieces of output, the prompt tokens each call found in the compiled step's cache from the call
before, and whether both outputs are identical (and, with `--check-eager`, equal to the base's eager greedy
`generate()`). The plain answer joins the chat.

    python benchmarks/long_context.py --conversations 2 --turns 12 --max-new-tokens 128 --check-eager \
        --output benchmarks/results/long_context_amd_epyc.json
"""

import argparse
import json
import time

import torch
from transformers.generation.streamers import BaseStreamer

from hf_bpd import BlockwiseParallelForCausalLM, load_tokenizer
from hf_bpd.evaluation.bench import load_questions, machine_info, print_figures


class Clock(BaseStreamer):
    """Times every piece of output `generate()` streams (the prompt's put first)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def longest_gap(self) -> float:
        pieces = self.times[1:]  # after the prompt
        return max((b - a for a, b in zip(pieces, pieces[1:])), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd")
    parser.add_argument("--questions", default="benchmarks/dev_prompts.jsonl")
    parser.add_argument("--turns", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=1, help="chats, each on the next --turns questions")
    parser.add_argument("--check-eager", action="store_true",
                        help="also compare each answer with the base's eager greedy generate() (untimed)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = BlockwiseParallelForCausalLM.from_pretrained(args.model)
    tokenizer = load_tokenizer(args.model)
    questions = load_questions(args.questions)
    methods = {"compiled plain": dict(use_heads=False, compile=True), "default": {}}
    rows, totals = [], {m: [0, 0.0] for m in methods}
    for conversation in range(args.conversations):
        rows += chat(model, tokenizer, questions[conversation * args.turns:], methods, totals, args, conversation)
    summary = {name: round(n / s, 1) for name, (n, s) in totals.items()}
    long_rows = [r for r in rows if r["context"] >= 600]
    result = {"conversations": args.conversations, "turns": len(rows), "max_context": max(r["context"] for r in rows),
              "tokens_per_s": summary,
              "default_vs_compiled_plain": round(summary["default"] / summary["compiled plain"], 2),
              "default_vs_compiled_plain_contexts_from_600": round(
                  sum(r["default"]["tokens"] for r in long_rows) / sum(r["default"]["seconds"] for r in long_rows) /
                  (sum(r["compiled plain"]["tokens"] for r in long_rows) /
                   sum(r["compiled plain"]["seconds"] for r in long_rows)), 2) if long_rows else None,
              "longest_gap_s": max(r[m]["longest_gap_s"] for r in rows for m in methods),
              "compile_seconds": sum(r[m]["compile_seconds"] for r in rows for m in methods),
              "identical": sum(r["identical"] for r in rows),
              "identical_to_eager_generate": sum(r.get("identical_to_eager", False) for r in rows),
              "rows": rows, "machine": machine_info()}
    print_figures(result, args.output)


def chat(model, tokenizer, questions, methods, totals, args, conversation: int) -> list[dict]:
    """One conversation: per turn both methods (alternating which runs first), then the base's eager greedy
    `generate()` (`--check-eager`); the plain answer joins the chat."""
    messages, rows = [], []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": questions[turn % len(questions)]["turns"][0]})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        context = inputs["input_ids"].shape[1]
        if context > args.max_context and turn:
            break
        row, outputs = {"conversation": conversation + 1, "turn": turn + 1, "context": context}, {}
        for name in (list(methods) if turn % 2 == 0 else list(methods)[::-1]):
            clock = Clock()
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=clock,
                                 **methods[name])
            seconds = time.perf_counter() - start
            new = out.shape[1] - context
            outputs[name] = out
            totals[name][0] += new
            totals[name][1] += seconds
            row[name] = {"tokens_per_s": round(new / seconds, 1), "tokens": new, "seconds": round(seconds, 3),
                         "longest_gap_s": round(clock.longest_gap(), 3),
                         "compile_seconds": model.last_generation_stats.compile_seconds,
                         "reused_prompt_tokens": model.last_generation_stats.reused_prompt_tokens,
                         "block_efficiency": round(model.last_generation_stats.block_efficiency, 2)}
        row["identical"] = torch.equal(outputs["default"], outputs["compiled plain"])
        if args.check_eager:
            eager = model.base_lm.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
            row["identical_to_eager"] = torch.equal(outputs["default"], eager)
        rows.append(row)
        print(json.dumps(row), flush=True)
        answer = tokenizer.decode(outputs["compiled plain"][0, context:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    return rows


if __name__ == "__main__":
    main()
