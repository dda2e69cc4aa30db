"""Compare heads checkpoints by the block efficiency their drafts would reach, on the same prompts and references.

    python benchmarks/draft_quality.py --checkpoints checkpoints/smollm2-135m-instruct-bpd /tmp/heads-a /tmp/heads-b \
        --questions benchmarks/dev_prompts.jsonl --max-new-tokens 256 \
        --references benchmarks/results/dev_references_256.jsonl --output benchmarks/results/draft_quality.json

The base's greedy continuation of every prompt (the chat template; eager `generate()` for an fp32 base, compiled
plain decoding for a half-precision one: what each decoding is exact against) is computed once and kept in
`--references` (token ids; reused by later runs with the same prompts and length). `--questions` takes several files
and `--skip N` leaves out each one's first N prompts (a benchmark's `--limit N`), so choices are tuned on the rest.
Every checkpoint is then analysed teacher-forced along those references
(`hf_bpd.evaluation.analysis.analyze_prompt`): one base forward per prompt, the heads on every position. Greedy
decoding is exact, so the accepted lengths are the ones `generate()` would see: vanilla BPD (the heads' argmax;
sequential heads read the reference's tokens, which is what they read whenever their draft can count), the n-gram
rescorer's drafts (`--rescorer-from`: a checkpoint whose bundled 4-gram and alpha are used for every checkpoint, so
heads are compared under the same rescorer), and the oracle over the top-k lattice. Timing-free: the figures do not
depend on the machine's load.

`--drafters` adds feature-level drafters (`training/train_drafter.py`) for the first checkpoint's base: the block
efficiency of their chain drafts at each `--depths` (`hf_bpd.evaluation.drafter_quality`), along the same references.
`--union-budgets 7` adds a ceiling for drafting with both: the first checkpoint's default drafted block
(`BlockDrafter.drafts` as its generation config sets it up: rescored paths and prompt lookup's copy in a budget of
that many nodes, every node verified), each drafter's full top-k tree (`--tree-top-k`, at each depth) and the two
verified together (at every step the longer of their accepted drafts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.evaluation import analysis
from hf_bpd.evaluation.bench import encode_messages, load_questions
from hf_bpd.evaluation.decoders import REFERENCE, default_decoders


def references(model, tokenizer, questions, max_new_tokens: int, path: Path | None) -> dict[str, list[int]]:
    """`{prompt id: prompt + greedy continuation token ids}`, read from / added to `path` (JSONL): `model`'s base
    decoding plainly as `generate()` is exact against (eager for fp32, the compiled plain steps for half precision)."""
    # the method `hf-bpd bench` checks exactness against for this dtype
    decode = default_decoders()["ar-compiled" if model.dtype in (torch.bfloat16, torch.float16) else REFERENCE]
    stored = {}
    if path is not None and path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["max_new_tokens"] == max_new_tokens:
                stored[row["id"]] = row["ids"]
    for q in questions:
        key = str(q["id"])
        if key in stored:
            continue
        inputs = encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], None)
        with torch.no_grad():
            out, _ = decode(model, inputs, max_new_tokens)
        stored[key] = out[0].tolist()
        if path is not None:
            with path.open("a") as f:
                f.write(json.dumps({"id": key, "max_new_tokens": max_new_tokens,
                                    "prompt_tokens": inputs["input_ids"].shape[1], "ids": stored[key]}) + "\n")
        print(f"reference {key}: {len(stored[key]) - inputs['input_ids'].shape[1]} tokens", flush=True)
    return stored


def decoded(model, tokenizer, questions, refs, rescorer, max_new_tokens: int) -> dict:
    """Block efficiency of eager `generate(rescorer=...)` (the checkpoint's heads in use) over the prompts, and how
    many outputs equal the reference."""
    tokens = calls = exact = 0
    for q in questions:
        inputs = encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], None)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, rescorer=rescorer,
                             num_heads_to_use=model.config.num_heads, compile=False, prompt_lookup=False, draft_nodes=None,
                             draft_schedule="fixed")
        stats = model.last_generation_stats
        tokens += stats.new_tokens
        calls += stats.serial_calls
        exact += out[0].tolist() == refs[str(q["id"])]
    return {"block_efficiency": tokens / max(calls, 1), "exact": exact}


def drafters_along(paths, base, tokenizer, questions, refs) -> tuple[dict, list]:
    """The feature-level drafters at `paths`, and `[(reference ids, prompt length, base features)]` per question
    (the features every one of them reads), computed once for `drafter_rows` and `union_rows`."""
    from hf_bpd.evaluation import drafter_quality
    from hf_bpd.feature_drafter import FeatureDrafter

    drafters = {path: FeatureDrafter.load(path, base) for path in paths}
    layers = sorted({i for d in drafters.values() for i in d.layers_read()})  # what any of them fuses
    along = []
    for q in questions:
        ids = torch.tensor(refs[str(q["id"])])
        n = encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], None)["input_ids"].shape[1]
        along.append((ids, n, drafter_quality.base_features(base, ids, layers)))
    return drafters, along


def drafter_rows(drafters, along, depths) -> list[dict]:
    """The chain block efficiency of each feature-level drafter at each depth (`hf_bpd.evaluation.drafter_quality`)."""
    from hf_bpd.evaluation import drafter_quality

    rows = []
    for path, drafter in drafters.items():
        trained = json.loads((Path(path) / "training.json").read_text()).get("tokens")
        for depth in depths:
            runs = [(len(ids) - n, drafter_quality.chain_accepted_lengths(drafter, feats, ids, n, depth))
                    for ids, n, feats in along]
            be = drafter_quality.block_efficiency(runs)
            rows.append({"drafter": path, "trained_tokens": trained, "depth": depth, "block_efficiency": be})
            print(f"{path} (feature-level drafter, {trained} training tokens), chain of {depth}: block efficiency "
                  f"{be:.3f}", flush=True)
    return rows


def union_rows(model, drafters, along, budgets, depths, top_ks) -> list[dict]:
    """Block efficiency of `model`'s default drafted block at each node budget, of each drafter's full top-k trees,
    and of both verified together (`--union-budgets`)."""
    from hf_bpd.evaluation import drafter_quality as dq
    from hf_bpd.generation.config import drafting_options
    from hf_bpd.generation.decoding import plan_drafting

    drafter = plan_drafting(model, drafting_options({}, None, model.generation_config)).drafter
    blocks = {}
    for budget in budgets:
        drafter.set_draft_nodes(budget)
        blocks[budget] = [dq.block_accepted_by_position(drafter, feats, ids, n) for ids, n, feats in along]
    rows = [{"drafts": f"default block, {b} nodes", "block_efficiency":
             dq.block_efficiency([dq.walk(acc) for acc in blocks[b]])} for b in budgets]
    for path, feature in drafters.items():
        for depth in depths:
            trees = [dq.tree_accepted_by_position(feature, feats, ids, n, depth, top_ks) for ids, n, feats in along]
            for k in top_ks:
                rows.append({"drafts": f"{path}: top-{k} tree, depth {depth}", "block_efficiency": dq.block_efficiency(
                    [dq.walk(t[k]) for t in trees])})
                for b in budgets:
                    both = [dq.walk([max(x, y) for x, y in zip(acc, t[k])]) for acc, t in zip(blocks[b], trees)]
                    rows.append({"drafts": f"default block, {b} nodes + {path}: top-{k} tree, depth {depth}",
                                 "block_efficiency": dq.block_efficiency(both)})
    for row in rows:
        print(f"{row['drafts']}: block efficiency {row['block_efficiency']:.3f}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", nargs="+", required=True, help="heads checkpoint directories (same base)")
    p.add_argument("--questions", nargs="+", default=["benchmarks/dev_prompts.jsonl"])
    p.add_argument("--skip", type=int, default=0, help="leave out each --questions file's first N prompts")
    p.add_argument("--exclude", default=None, help="a prompt file whose prompts (by id) are skipped")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--stride", type=int, default=1, help="every N-th question (a spread subset)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--references", default=None, help="JSONL cache of the base's greedy continuations")
    p.add_argument("--rescorer-from", default="checkpoints/smollm2-135m-instruct-bpd",
                   help="checkpoint whose bundled n-gram rescorer scores every checkpoint's lattice ('' for none)")
    p.add_argument("--num-heads", default=None, help="comma-separated head counts to analyse, e.g. 3,4 (default: all)")
    p.add_argument("--top-k", default="1,4,16")
    p.add_argument("--generate", action="store_true",
                   help="also decode with the n-gram rescorer (eager generate()): the rescored block efficiency as "
                        "decoding sees it (for sequential heads the analysis' rescored/oracle figures are upper "
                        "bounds: their lattice is conditioned on the reference's tokens)")
    p.add_argument("--drafters", nargs="*", default=[],
                   help="feature-level drafters (folders written by training/train_drafter.py) for the first "
                        "checkpoint's base: their chain block efficiency along the same references")
    p.add_argument("--depths", default="4,6", help="drafting depths for --drafters")
    p.add_argument("--union-budgets", default=None,
                   help="with --drafters: node budgets of the first checkpoint's default block, e.g. 7, for the "
                        "ceiling of verifying it together with each drafter's full top-k tree")
    p.add_argument("--tree-top-k", default="1,2,4", help="tree widths for --union-budgets")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    excluded = {q["id"] for q in load_questions(args.exclude)} if args.exclude else set()
    questions = [q for f in args.questions for q in load_questions(f)[args.skip:] if q["id"] not in excluded]
    questions = questions[:: args.stride][: args.limit]
    first = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.checkpoints[0])
    base, tokenizer = first.base_lm, hf_bpd.load_tokenizer(args.checkpoints[0])
    refs = references(first, tokenizer, questions, args.max_new_tokens,
                      Path(args.references) if args.references else None)
    rescorer = None
    if args.rescorer_from:
        donor = first if args.rescorer_from == args.checkpoints[0] else \
            hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.rescorer_from, base_model=base)
        rescorer = donor.bundled_rescorers.get("ngram")
    top_ks = [int(k) for k in args.top_k.split(",")]
    rows = []
    for path in args.checkpoints:
        model = first if path == args.checkpoints[0] else \
            hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(path, base_model=base)
        all_heads = model.config.num_heads
        for num_heads in sorted({int(h) for h in args.num_heads.split(",")} if args.num_heads else {all_heads}):
            model.config.num_heads = min(num_heads, all_heads)
            records = []
            for q in questions:
                ids = torch.tensor([refs[str(q["id"])]])
                n = encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], None)["input_ids"].shape[1]
                records.append(analysis.analyze_prompt(model, ids[:, :n], args.max_new_tokens, top_ks, rescorer,
                                                       prompt_id=str(q["id"]), category=q.get("category", ""),
                                                       reference=ids))
            summary = analysis.summarize_by_category(records)
            rows.append({"checkpoint": path, "head_type": model.config.head_type, "num_heads": model.config.num_heads,
                         "summary": summary})
            s = summary["all"]
            if args.generate and rescorer is not None:  # the rescored drafts as generate() really makes them
                s["generated"] = decoded(model, tokenizer, questions, refs, rescorer, args.max_new_tokens)
                print(f"  generate(rescorer=ngram): block efficiency {s['generated']['block_efficiency']:.3f}, "
                      f"{s['generated']['exact']}/{len(questions)} equal to the reference", flush=True)
            rescored = s.get("rescored", {}).get("block_efficiency", float("nan"))
            print(f"{path} ({model.config.head_type}, {model.config.num_heads} heads): vanilla "
                  f"{s['vanilla']['block_efficiency']:.3f}  + n-gram {rescored:.3f}  oracle "
                  + " ".join(f"top-{k} {v:.3f}" for k, v in s["oracle_block_efficiency"].items()), flush=True)
        model.config.num_heads = all_heads
    if args.drafters:
        depths = [int(d) for d in args.depths.split(",")]
        drafters, along = drafters_along(args.drafters, base, tokenizer, questions, refs)
        rows += drafter_rows(drafters, along, depths)
        if args.union_budgets:
            rows += union_rows(first, drafters, along, [int(b) for b in args.union_budgets.split(",")], depths,
                               [int(k) for k in args.tree_top_k.split(",")])
    if args.output:
        Path(args.output).write_text(json.dumps({"settings": vars(args), "results": rows}, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
