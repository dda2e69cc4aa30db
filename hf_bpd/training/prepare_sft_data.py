"""Mix instruction data into one ShareGPT JSONL for head training, holding out the dev prompts.

    python training/prepare_sft_data.py --data DATA_DIR \\
        --exclude benchmarks/dev_prompts.jsonl benchmarks/tune_prompts.jsonl \\
        --per-source 320 --output data/sft_mix.jsonl [--distilled data/distilled.jsonl]
"""

import argparse
import json
from pathlib import Path

from datasets import load_dataset

from .data import conversation_messages, held_out_prompts, record_prompt
from .make_dev_split import SOURCES, shuffled


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="the folder holding the source files (SOURCES)")
    p.add_argument("--exclude", nargs="*", default=["benchmarks/dev_prompts.jsonl", "benchmarks/tune_prompts.jsonl"],
                   help="prompt files held out of training (dev and tuning splits)")
    p.add_argument("--per-source", type=int, default=1500)
    p.add_argument("--distilled", nargs="*", default=[], help="self-distilled ShareGPT files to include whole")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="data/sft_mix.jsonl")
    args = p.parse_args(argv)
    held_out = held_out_prompts(args.exclude)
    rows, skipped = [], 0
    for category, name in SOURCES.items():
        records = shuffled(load_dataset("json", data_files=str(Path(args.data) / name), split="train"), args.seed)
        kept = 0
        for record in records:
            if kept >= args.per_source:
                break
            try:
                messages = conversation_messages(record)
            except ValueError:
                skipped += 1
                continue
            if record_prompt(record) in held_out:
                continue
            rows.append({"source": category, "conversations": [
                {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in messages]})
            kept += 1
    for path in args.distilled:
        with open(path) as f:
            for line in f:
                conversations = json.loads(line)["conversations"]
                if conversations[0]["value"] not in held_out:
                    rows.append({"source": "distilled", "conversations": conversations})
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} conversations to {args.output} ({skipped} records without an answer skipped)")


if __name__ == "__main__":
    main()
