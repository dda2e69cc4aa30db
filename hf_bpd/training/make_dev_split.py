"""Hold out a dev split and a tuning split of instruction prompts (MT-bench layout: question_id, category, turns).

    python training/make_dev_split.py --data DATA_DIR --per-source 10 --output benchmarks/dev_prompts.jsonl \\
        --tune-per-source 2 --tune-output benchmarks/tune_prompts.jsonl

The dev prompts (the first `--per-source` of each source's shuffled order) are what `hf-bpd bench` reports on; the
tuning prompts (the last `--tune-per-source`, disjoint from the dev ones) are where rescorer weights α are chosen.
Both are excluded from self-distillation and head training (`self_distill.py --exclude`, `prepare_sft_data.py
--exclude`).
"""

import argparse
import json
import random
from pathlib import Path

from .data import load_prompts

SOURCES = {
    "code": "gpteacher_codegen_instruct.json",
    "roleplay": "gpteacher_roleplay_instruct.json",
    "code-alpaca": "code_alpaca_2k.json",
    "math": "gsm8k_train.jsonl",
    "general": "alpaca_seed_tasks.jsonl",
}


def shuffled(records, seed: int) -> list:
    """The records in a deterministic shuffled order (the same seed gives the same order in every script)."""
    records = list(records)
    random.Random(seed).shuffle(records)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="the folder holding the source files (SOURCES)")
    p.add_argument("--per-source", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/dev_prompts.jsonl")
    p.add_argument("--tune-per-source", type=int, default=2)
    p.add_argument("--tune-output", default="benchmarks/tune_prompts.jsonl")
    args = p.parse_args(argv)
    dev, tune = [], []
    for category, name in SOURCES.items():
        prompts = shuffled(load_prompts(Path(args.data) / name), args.seed)
        if len(prompts) < args.per_source + args.tune_per_source:
            raise SystemExit(f"{name} has only {len(prompts)} prompts: lower --per-source / --tune-per-source")
        dev += [{"question_id": r["id"], "category": category, "turns": [r["prompt"]]}
                for r in prompts[: args.per_source]]
        tune += [{"question_id": r["id"], "category": category, "turns": [r["prompt"]]}
                 for r in prompts[len(prompts) - args.tune_per_source:]]
    for rows, path, what in ((dev, args.output, "dev"), (tune, args.tune_output, "tuning")):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} {what} prompts to {path}")


if __name__ == "__main__":
    main()
