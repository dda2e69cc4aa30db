"""Latency of exact p-best n-gram lattice rescoring (paper App. H.2, Tables 12-13): compiled vs pure Python.

The n-gram: a 4-gram over SmolLM2 token ids of Wikipedia (`enwiki_wikiextractor_AA`, WikiExtractor `<doc>` lines
dropped), built once with `hf_bpd.build_ngram` into `$HF_BPD_CACHE/ngram/` and reused.

The lattices are head-like: for a position t of a token sequence, row i (the token i + 2 steps after the last
context token) holds the top-k of SmolLM2's teacher-forced next-token distribution at position t + i, flattened by
a temperature 1 + i/2 (heads grow less certain with distance, paper Fig. 3b), i.e. what ideal heads would draft,
top tokens best first. Two sources of sequences: `wiki`, held-out Wikipedia (`enwiki_wikiextractor_AB`, the
n-gram's own domain: most short n-grams of the lattice are known, the hardest case for the search), and `chat`,
SmolLM2's greedy answers to the dev prompts (what its heads are trained on; off the n-gram's domain). Each timing
is one `NgramRescorer.rescore` call, Python overhead included (tensor conversion, `Draft` objects).

    python benchmarks/ngram_latency.py            # ~8 min; builds the 4-gram on first use (~1.5 min)
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.rescorers import kenlm, ngram
from hf_bpd.lattice import Lattice

DATA = Path("/work/shared/data")
TABLE12 = [(8, 16, p) for p in (1, 2, 4, 8, 16)]  # (heads, k, p)
TABLE13 = [(h, k, 1) for h in (4, 8, 16) for k in (2, 4, 8, 16)]


def build_model(args, tokenizer) -> Path:
    if not args.model_file.exists():
        kenlm.build_ngram(args.train_text, tokenizer, args.model_file, order=4, memory="1G",
                          max_lines=args.max_lines, strip_wiki_markup=True)
    return args.model_file


def wiki_sequences(args, tokenizer, length=160):
    """Token sequences of held-out Wikipedia (in the n-gram's domain)."""
    import gzip

    with gzip.open(args.heldout_text, "rt") as f:
        text = " ".join(line.strip() for line in f if line.strip() and not line.startswith(("<doc", "</doc")))
    ids = tokenizer(text[: 4000 * args.chunks], add_special_tokens=False)["input_ids"]
    return [ids[c * length:(c + 1) * length] for c in range(args.chunks)]


@torch.no_grad()
def chat_sequences(args, base, tokenizer, new_tokens=128):
    """SmolLM2's own greedy answers to dev prompts (what its heads learn to draft; off the n-gram's domain)."""
    with open(args.prompts) as f:
        prompts = [json.loads(line)["turns"][0] for line in f][: args.chunks]
    sequences = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = base.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        sequences.append(out[0, max(0, ids.shape[1] - 32):].tolist())  # 32 prompt tokens of context, the answer
    return sequences


@torch.no_grad()
def head_like_rows(base, sequences):
    """Per sequence: `(ids, tokens, logprobs)`, `tokens`/`logprobs` `(16 heads, len(ids), 16)`: the top-16 of the
    base's next-token distribution at each position, flattened by temperature 1 + head / 2."""
    temperatures = torch.tensor([1 + i / 2 for i in range(16)])
    for ids in sequences:
        logits = base(torch.tensor([ids])).logits[0].float()  # (length, vocab)
        top = torch.log_softmax(logits[None] / temperatures[:, None, None], -1).topk(16, dim=-1)
        yield ids, top.indices, top.values


def lattices(rows, h, k, n):
    """`n` `(context, lattice (h, k))` pairs at evenly spaced positions (after 32 tokens) of the sequences."""
    rows = [row for row in rows if len(row[0]) > 32 + h + 1]
    out = []
    for ids, tokens, logprobs in rows:
        for t in torch.linspace(32, len(ids) - h - 1, -(-n // len(rows))).long().tolist():
            index = torch.arange(h)  # head i drafts the token after position t + i
            out.append((ids[: t + 1], Lattice(tokens[index, t + index, :k], logprobs[index, t + index, :k])))
    return out[:n]


def time_rescorer(rescorer, cases, p):
    """Median and p90 latency (ms) of `rescorer.rescore` over `cases`, and the drafts it returned."""
    times, drafts = [], []
    for context, lattice in cases:
        start = time.perf_counter()
        drafts.append(rescorer.rescore(lattice, context, p))
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))], drafts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-file", type=Path,
                        default=hf_bpd.hub.base_models.cache_dir() / "ngram" / "enwiki_AA_smollm2_4gram.bin")
    parser.add_argument("--train-text", default=str(DATA / "enwiki_wikiextractor_AA.txt.gz"))
    parser.add_argument("--heldout-text", default=str(DATA / "enwiki_wikiextractor_AB.txt.gz"))
    parser.add_argument("--max-lines", type=int, default=140_000, help="training lines (140k: ~10M tokens)")
    parser.add_argument("--prompts", default="benchmarks/dev_prompts.jsonl", help="chat prompts (jsonl, turns)")
    parser.add_argument("--source", default="wiki,chat", help="lattice sources: wiki (held-out Wikipedia, "
                        "in domain), chat (SmolLM2's answers to --prompts)")
    parser.add_argument("--chunks", type=int, default=10, help="held-out sequences per source")
    parser.add_argument("--lattices", type=int, default=200, help="lattices timed per setting (compiled)")
    parser.add_argument("--python-lattices", type=int, default=30, help="lattices timed per setting (Python)")
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--output", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(2)

    base, tokenizer = hf_bpd.load_base("smollm2-135m-instruct")
    path = build_model(args, tokenizer)
    info = json.loads(kenlm.info_path(path).read_text())
    fast = ngram.NgramRescorer(path, alpha=args.alpha, backend="compiled")
    slow = ngram.NgramRescorer(path, alpha=args.alpha, backend="python")
    print(f"4-gram {path}: {info['tokens']:,} training tokens, {sum(info['ngram_counts']):,} n-grams "
          f"{info['ngram_counts']}, {path.stat().st_size / 2**20:.0f} MiB ({info['binary_type']})\n")

    results = []
    for source in args.source.split(","):
        sequences = wiki_sequences(args, tokenizer) if source == "wiki" else chat_sequences(args, base, tokenizer)
        rows = list(head_like_rows(base, sequences))
        print(f"## Lattices from {source} ({len(rows)} sequences); ms per rescore() call\n")
        print("| heads | k | p | compiled median | compiled p90 | Python median | Python p90 | same drafts |")
        print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
        for h, k, p in TABLE12 + TABLE13[:7] + TABLE13[8:]:  # 8x16 p=1 is Table 12's first row
            cases = lattices(rows, h, k, args.lattices)
            for rescorer in (fast, slow):  # warm-up
                rescorer.rescore(cases[0][1], cases[0][0], p)
            fast_median, fast_p90, _ = time_rescorer(fast, cases, p)
            few = cases[:: max(1, len(cases) // args.python_lattices)][: args.python_lattices]
            slow_median, slow_p90, slow_drafts = time_rescorer(slow, few, p)
            same = slow_drafts == [fast.rescore(lattice, context, p) for context, lattice in few]
            results.append(dict(source=source, heads=h, k=k, p=p, compiled_median_ms=fast_median,
                                compiled_p90_ms=fast_p90, python_median_ms=slow_median, python_p90_ms=slow_p90,
                                lattices=len(cases), python_lattices=len(few), same_drafts=same))
            print(f"| {h} | {k} | {p} | {fast_median:.3f} | {fast_p90:.3f} | {slow_median:.2f} | {slow_p90:.2f} "
                  f"| {'yes' if same else 'NO'} |", flush=True)
        print()
    if args.output:
        args.output.write_text(json.dumps({"model": str(path), **info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
