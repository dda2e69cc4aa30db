"""Build `benchmarks/exactness_prompts.jsonl`: the 50 dev prompts plus 150 prompts of the shared prompt pool that no
distilled (training) file answers, for the compiled-vs-eager exactness measurement (issue 13: >= 200 prompts).

    python benchmarks/make_exactness_prompts.py --pool ../shared/data/prompt_pool.jsonl.gz

The sample is seeded; prompts of the distilled training files (shared and training/data/) and of every benchmark
file are left out, and `self_distill.py` is run with this file in `--exclude` so they stay out of training data.
"""

import argparse
import gzip
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def distilled_prompts(path: Path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {json.loads(line)["conversations"][0]["value"] for line in f}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", default=str(ROOT.parent / "shared/data/prompt_pool.jsonl.gz"))
    p.add_argument("--distilled", nargs="*", default=[str(ROOT.parent / "shared/data/distilled_smollm2_greedy.jsonl.gz"),
                                                     *map(str, sorted((ROOT / "training/data").glob("*.jsonl.gz")))])
    p.add_argument("--count", type=int, default=150)
    p.add_argument("--max-chars", type=int, default=1200)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--output", default=str(ROOT / "benchmarks/exactness_prompts.jsonl"))
    args = p.parse_args()
    dev = [json.loads(line) for line in (ROOT / "benchmarks/dev_prompts.jsonl").open()]
    held = {q["turns"][0] for name in ("dev", "tune", "bench")
            for q in map(json.loads, (ROOT / f"benchmarks/{name}_prompts.jsonl").open())}
    for path in args.distilled:
        held |= distilled_prompts(Path(path))
    with gzip.open(args.pool, "rt") as f:
        pool = [json.loads(line) for line in f]
    eligible = [r for r in pool if r["prompt"] not in held and len(r["prompt"]) <= args.max_chars]
    sample = random.Random(args.seed).sample(eligible, args.count)
    with open(args.output, "w") as out:
        for q in dev:
            out.write(json.dumps(q) + "\n")
        for r in sample:
            out.write(json.dumps({"question_id": r["id"], "category": r["source"], "turns": [r["prompt"]]}) + "\n")
    print(f"{len(dev)} dev + {len(sample)} pool prompts ({len(eligible)} eligible) -> {args.output}")


if __name__ == "__main__":
    main()
