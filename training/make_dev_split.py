"""Hold out a dev split of instruction prompts (MT-bench layout: question_id, category, turns).

    python training/make_dev_split.py --data ../shared/data --per-source 10 --output benchmarks/dev_prompts.jsonl

The dev prompts are excluded from self-distillation (`self_distill.py --exclude`) and used by `hf-bpd bench`.
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_bpd.data import load_prompts  # noqa: E402

SOURCES = {
    "code": "gpteacher_codegen_instruct.json",
    "roleplay": "gpteacher_roleplay_instruct.json",
    "code-alpaca": "code_alpaca_2k.json",
    "math": "gsm8k_train.jsonl",
    "general": "alpaca_seed_tasks.jsonl",
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    p.add_argument("--per-source", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/dev_prompts.jsonl")
    args = p.parse_args(argv)
    rows = []
    for category, name in SOURCES.items():
        prompts = load_prompts(Path(args.data) / name)
        random.Random(args.seed).shuffle(prompts)
        for r in prompts[: args.per_source]:
            rows.append({"question_id": r["id"], "category": category, "turns": [r["prompt"]]})
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} dev prompts to {args.output}")


if __name__ == "__main__":
    main()
