"""Self-distillation: the base model's own answers to a prompt set, written as ShareGPT JSONL.

Heads learn to predict what *the base* will say (Medusa's self-distillation), so the training targets are the base's
greedy (or sampled) outputs. Batched, resumable (appends, and skips ids already in the output), deterministic.

    python training/self_distill.py --model smollm2-135m-instruct --prompts a.json b.jsonl \\
        --output data/distilled.jsonl --max-new-tokens 256 --batch-size 32 [--limit N] [--do-sample --seed 0]
    python training/self_distill.py ... --device cuda --dtype bfloat16 --batch-size 128   # on a GPU
    python training/self_distill.py --model checkpoints/smollm2-135m-instruct-bpd ...      # batched drafting
    python training/self_distill.py --prompts pool.jsonl.gz --sources gpteacher_codegen lima ...  # some sources only
"""

import argparse
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..cli.common import load_for_generation
from .data import held_out_prompts, load_prompts
from .make_dev_split import shuffled


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the base model, or a heads checkpoint: then its base answers and the batches are decoded "
                        "with batched drafting (the same answers, fewer serial forward passes)")
    p.add_argument("--prompts", nargs="+", required=True, help="prompt files (Alpaca/GSM8K/MT-bench/ShareGPT/text)")
    p.add_argument("--output", required=True)
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files whose prompts are held out (dev split)")
    p.add_argument("--sources", nargs="*", default=None,
                   help="only prompts whose record names one of these sources (the prompt pool's `source` field)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts (after interleaving sources)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... or auto (a GPU when there is one)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the base's dtype")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    p.add_argument("--compile", action="store_true",
                   help="decode a plain base's batches with hf_bpd's compiled steps: the base's prebuilt steps "
                        "(built first when missing, as `hf-bpd compile` does) where its batches can run on them, "
                        "else compile='wait' (each rows x width shape compiles once per process)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        p.error(f"--device: not a device: {args.device!r} (cpu, cuda, cuda:1, ... or auto)")
    if kind != "cpu" and not (torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == kind):
        p.error(f"--device {args.device}: no such device on this machine (cpu, or auto for whatever there is)")
    return args


def interleave(sources: list[list[dict]]) -> list[dict]:
    """Round-robin over sources so a partial run already covers every source."""
    merged = []
    for group in itertools.zip_longest(*sources):
        merged.extend(r for r in group if r is not None)
    return merged


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    held_out = held_out_prompts(args.exclude)
    sources = []
    for path in args.prompts:
        records = [r for r in load_prompts(path) if r["prompt"] not in held_out]
        if args.sources is not None:
            # one round-robin group per named source, so a partial run covers each of them
            sources += [shuffled([r for r in records if r["source"] == name], args.seed) for name in args.sources]
        else:
            sources.append(shuffled(records, args.seed))
    prompts = interleave(sources)[: args.limit]

    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if output.exists():
        with output.open() as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    todo = [r for r in prompts if r["id"] not in done]
    model, tokenizer = load_for_generation(args.model, args.dtype, "cpu")
    drafting = {"compile": False} if hasattr(model, "heads") else {}  # batched drafting is eager
    model.to(args.device)
    if args.compile and not hasattr(model, "heads"):  # plain decoding through the compiled batch steps
        from ..evaluation.batch_bench import build_batch_artifacts
        from ..evaluation.decoders import plain_wrapper

        # the base's prebuilt steps when its batches can run on them: built once per machine and loaded, where
        # in-process compiles of a large fp32 base would hold frozen copies of its weights
        on_artifacts = build_batch_artifacts(model)
        model, drafting = plain_wrapper(model), {"use_heads": False, "compile": True if on_artifacts else "wait"}

    def chat(prompt: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)

    # Prompts longer than --max-prompt-tokens are skipped, never truncated (truncation would cut the chat
    # template's assistant header and the answer would be to a different prompt).
    todo = [r for r in todo if len(tokenizer(chat(r["prompt"]), add_special_tokens=False)["input_ids"])
            <= args.max_prompt_tokens]
    print(f"{len(prompts)} prompts, {len(done)} already done, {len(todo)} to generate", file=sys.stderr)
    if not todo:
        return 0
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    new_tokens, start = 0, time.perf_counter()
    with output.open("a") as out, tqdm(total=len(todo), desc="self-distill", unit="prompt") as bar:
        for i in range(0, len(todo), args.batch_size):
            batch = todo[i: i + args.batch_size]
            texts = [chat(r["prompt"]) for r in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
            gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                       pad_token_id=tokenizer.pad_token_id)
            if args.do_sample:
                gen["temperature"] = args.temperature
            with torch.no_grad():
                seqs = model.generate(**enc, **gen, **drafting)
            for record, seq in zip(batch, seqs[:, enc["input_ids"].shape[1]:]):
                ids = seq.tolist()
                if tokenizer.eos_token_id in ids:
                    ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
                new_tokens += len(ids)
                answer = tokenizer.decode(ids, skip_special_tokens=True)
                out.write(json.dumps({"id": record["id"], "source": record["source"], "conversations": [
                    {"from": "human", "value": record["prompt"]}, {"from": "gpt", "value": answer}]}) + "\n")
            out.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
