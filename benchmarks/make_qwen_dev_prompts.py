"""Dev prompt sets for the Qwen2.5-Coder bases: code and chat, from the prompt pool, disjoint from every other
benchmark file (and so held out of self-distillation, which excludes them).

    python benchmarks/make_qwen_dev_prompts.py --pool ../shared/data/prompt_pool.jsonl.gz --per-source 8

writes benchmarks/qwen_code_prompts.jsonl (gpteacher_codegen, codealpaca_2k, gpteacher_toolformer) and
benchmarks/qwen_chat_prompts.jsonl (lima, alpaca_5000, instructionwild_en, gpteacher_roleplay) in the MT-bench
layout `hf-bpd bench --questions` reads. Prompts over 600 characters are skipped (a short dev set should not be
dominated by a few long prompt passes).
"""

import argparse
import gzip
import json
import random
from pathlib import Path

SETS = {
    "code": ("gpteacher_codegen", "codealpaca_2k", "gpteacher_toolformer"),
    "chat": ("lima", "alpaca_5000", "instructionwild_en", "gpteacher_roleplay"),
}
OTHER_BENCHMARKS = ("dev_prompts.jsonl", "tune_prompts.jsonl", "bench_prompts.jsonl", "exactness_prompts.jsonl",
                    "prose_prompts.jsonl")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", default="../shared/data/prompt_pool.jsonl.gz")
    p.add_argument("--per-source", type=int, default=8)
    p.add_argument("--seed", type=int, default=72)
    p.add_argument("--max-chars", type=int, default=600)
    args = p.parse_args(argv)
    here = Path(__file__).parent
    taken = {turn for name in OTHER_BENCHMARKS if (here / name).exists()
             for line in (here / name).open() if line.strip() for turn in json.loads(line)["turns"]}
    with gzip.open(args.pool, "rt") as f:
        pool = [json.loads(line) for line in f]
    for name, sources in SETS.items():
        rows = []
        for source in sources:
            candidates = [r for r in pool if r["source"] == source and r["prompt"] not in taken
                          and len(r["prompt"]) <= args.max_chars]
            random.Random(args.seed).shuffle(candidates)
            rows += [{"question_id": r["id"], "category": source, "turns": [r["prompt"]]}
                     for r in candidates[: args.per_source]]
        with (here / f"qwen_{name}_prompts.jsonl").open("w") as out:
            out.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"qwen_{name}_prompts.jsonl: {len(rows)} prompts")


if __name__ == "__main__":
    main()
