"""Base features for feature-level drafters: what the base computes over text in one prompt pass, stored in shards.

A feature-level drafter (EAGLE-style: a small decoder layer over the token embedding and the base's hidden state)
learns from the base's features and next-token distributions, which a prompt-pass forward gives for every position
of *any* text at once, no generation needed. `extract_features` runs the base over a fixed stream of sequences and
writes, per batch of sequences, one safetensors shard into a folder:

| tensor | shape | dtype | what |
| --- | --- | --- | --- |
| `input_ids` | (n, L) | int32 | the tokens (right-padded with 0 after `lengths`) |
| `lengths` | (n,) | int32 | each sequence's length |
| `hidden_<i>` | (n, L, hidden) | bfloat16 | the base's hidden state after decoder layer `i` (`-1`: the final, normed one, what the output layer reads) |
| `top_logprobs`, `top_ids` | (n, L, k) | float16, int32 | the base's k most likely next tokens at every position, log-probabilities |

`manifest.json` records the base, the dtype, the layers, k, L, the sources and, per shard, its sequences and
tokens; extraction resumes after the last complete shard (a shard is written to a temporary file and renamed, then
the manifest). The stream (`sequence_stream`) is deterministic and interleaves its sources round-robin, so its first
1M, 3M, 10M tokens are each a mixture of all of them (a learning curve trains on prefixes of one extraction).
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from .data import _records, conversation_messages, held_out_prompts, record_prompt

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def chat_sequences(path: str | Path, tokenizer, held_out: set[str], max_length: int) -> Iterator[list[int]]:
    """Chat-template token ids of every conversation in `path` (ShareGPT, Alpaca, GSM8K, or the distilled answers'
    `{"prompt", "answer"}`) whose prompt is not held out."""
    for record in _records(path):
        if record.get("prompt") and record.get("answer") is not None:
            messages = [{"role": "user", "content": record["prompt"]},
                        {"role": "assistant", "content": record["answer"]}]
        else:
            try:
                messages = conversation_messages(record)
            except ValueError:
                continue
        prompt = record_prompt(record) or next((m["content"] for m in messages if m["role"] == "user"), None)
        if prompt is None or prompt.strip() in held_out:
            continue
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        if len(ids) >= 8:
            yield ids[:max_length]


def wikipedia_sequences(path: str | Path, tokenizer, max_length: int) -> Iterator[list[int]]:
    """Plain text of the wikiextractor dump in `path` (`<doc>` markers dropped), one sequence per article piece of
    up to `max_length` tokens (BOS first where the tokenizer adds one)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines: list[str] = []
        for line in f:
            if line.startswith("<doc "):
                lines = []
            elif line.strip() == "</doc>":
                text = "\n".join(lines[1:]).strip()  # the title repeats as the first line
                ids = tokenizer(text, add_special_tokens=True)["input_ids"] if text else []
                for start in range(0, len(ids), max_length):
                    piece = ids[start:start + max_length]
                    if len(piece) >= 64:
                        yield piece
            else:
                lines.append(line.rstrip("\n"))


def source_weight(source: str) -> tuple[str, int]:
    """`"PATH*N"` -> `(PATH, N)`: N sequences of that source per round (`"PATH"`: one)."""
    path, star, weight = str(source).rpartition("*")
    if star and weight.isdigit() and int(weight) > 0:
        return path, int(weight)
    return str(source), 1


def sequence_stream(sources: list[str], tokenizer, held_out: set[str], max_length: int) -> Iterator[list[int]]:
    """The sources' sequences interleaved round-robin, `PATH*N` giving N per round (a source that runs out drops
    out)."""
    iterators = []
    for source in sources:
        path, weight = source_weight(source)
        if not Path(path).exists():
            raise ValueError(f"feature source {path} does not exist: pass existing files to --sources")
        it = (wikipedia_sequences(path, tokenizer, max_length) if "wiki" in Path(path).name
              else chat_sequences(path, tokenizer, held_out, max_length))
        iterators.append([it, weight])
    while iterators:
        for entry in list(iterators):
            for _ in range(entry[1]):
                try:
                    yield next(entry[0])
                except StopIteration:
                    iterators.remove(entry)
                    break


@torch.no_grad()
def batch_features(base, batch: list[list[int]], layers: list[int], top_k: int,
                   on_device: bool = False) -> dict[str, torch.Tensor]:
    """One forward over a right-padded batch: the shard tensors of the table in the module docstring (`on_device`:
    left on the base's device, hidden states in the base's dtype, for training online)."""
    length = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    for row, seq in enumerate(batch):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    device = base.device
    out = base(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
    states = out.hidden_states  # (embeddings, after layer 0, ..., after the last layer, normed)
    tensors = {"input_ids": ids.to(torch.int32), "lengths": mask.sum(1).to(torch.int32)}
    for layer in layers:
        hidden = states[-1] if layer == -1 else states[layer + 1]
        tensors[f"hidden_{layer}"] = hidden if on_device else hidden.to(torch.bfloat16)
    logits = out.logits.float()
    top = logits.topk(top_k, dim=-1)  # then normalised: no (batch, length, vocab) log-softmax is written
    tensors["top_logprobs"] = (top.values - logits.logsumexp(-1, keepdim=True)).to(torch.float16)
    tensors["top_ids"] = top.indices.to(torch.int32)
    if on_device:
        return {k: v.to(device) for k, v in tensors.items()}
    return {k: v.cpu().contiguous() for k, v in tensors.items()}


def online_batches(base, stream: Iterator[list[int]], max_tokens: int, batch_size: int, top_k: int = 8,
                   pool: int = 256, seed: int = 0, layers: list[int] = (-1,)) -> Iterator[dict[str, torch.Tensor]]:
    """Feature batches computed on the fly (training without stored features), on the base's device, with the
    hidden states of `layers` (-1: the final one): `pool` sequences at a time from `stream`, batched by length, the
    batches in a seeded random order, until `max_tokens` tokens were given."""
    rng, given = random.Random(seed), 0
    while given < max_tokens:
        sequences = sorted(itertools.islice(stream, pool), key=len)
        if not sequences:
            return
        groups = [sequences[i:i + batch_size] for i in range(0, len(sequences), batch_size)]
        rng.shuffle(groups)
        for group in groups:
            if given >= max_tokens:
                return
            batch = batch_features(base, group, list(layers), top_k, on_device=True)
            given += int(batch["lengths"].sum())
            yield batch


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return None


def extract_features(base, tokenizer, sources: list[str], folder: str | Path, max_tokens: int,
                     held_out: set[str] = frozenset(), layers: tuple[int, ...] = (-1,), top_k: int = 8,
                     max_length: int = 512, batch_size: int = 4, shard_sequences: int = 256,
                     base_name: str = "") -> dict:
    """Extract features of the stream's sequences until `max_tokens` tokens are stored (resuming a folder that
    holds an earlier, compatible extraction); returns the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"base": base_name, "dtype": str(base.dtype), "layers": list(layers), "top_k": top_k,
                "max_length": max_length, "sources": [str(s) for s in sources]}
    manifest = read_manifest(folder) or {**settings, "shards": []}
    if {k: manifest.get(k) for k in settings} != settings:
        raise ValueError(f"{folder} holds features extracted with other settings ({folder / MANIFEST}): pass another "
                         "folder, or the same settings to resume")
    done_sequences = sum(s["sequences"] for s in manifest["shards"])
    done_tokens = sum(s["tokens"] for s in manifest["shards"])
    stream = sequence_stream(sources, tokenizer, held_out, max_length)
    for _ in range(done_sequences):  # resume: the stream is deterministic
        next(stream, None)
    start = time.perf_counter()
    while done_tokens < max_tokens:
        sequences = []
        for seq in stream:
            sequences.append(seq)
            if len(sequences) == shard_sequences or done_tokens + sum(map(len, sequences)) >= max_tokens:
                break
        if not sequences:
            break
        sequences.sort(key=len)  # batches of similar lengths pad little
        parts = [batch_features(base, sequences[i:i + batch_size], list(layers), top_k)
                 for i in range(0, len(sequences), batch_size)]
        shard = _merge(parts, max(map(len, sequences)))
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        partial = folder / f".{name}.{os.getpid()}.tmp"
        save_file(shard, str(partial))
        os.replace(partial, folder / name)
        tokens = int(shard["lengths"].sum())
        manifest["shards"].append({"file": name, "sequences": len(sequences), "tokens": tokens})
        done_sequences, done_tokens = done_sequences + len(sequences), done_tokens + tokens
        _write_manifest(folder, manifest)
        rate = sum(map(len, sequences)) / max(time.perf_counter() - start, 1e-9)
        start = time.perf_counter()
        logger.info("%s: %d tokens (%d sequences), %.0f tokens/s", name, done_tokens, done_sequences, rate)
    return manifest


def _merge(parts: list[dict], length: int) -> dict[str, torch.Tensor]:
    """Batches padded to one length and stacked."""
    out = {}
    for key in parts[0]:
        tensors = []
        for part in parts:
            t = part[key]
            if t.dim() >= 2 and t.shape[1] < length:
                pad = torch.zeros((t.shape[0], length - t.shape[1], *t.shape[2:]), dtype=t.dtype)
                t = torch.cat([t, pad], 1)
            tensors.append(t)
        out[key] = torch.cat(tensors).contiguous()
    return out


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)


DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"  # the development data beside the repository
DEFAULT_SOURCES = ["training/data/distilled_smollm2_greedy.jsonl.gz", f"{DATA}/gpteacher_codegen_instruct.json",
                   f"{DATA}/gpteacher_roleplay_instruct.json", f"{DATA}/code_alpaca_2k.json",
                   f"{DATA}/gsm8k_train.jsonl", f"{DATA}/enwiki_wikiextractor_AA.txt.gz",
                   f"{DATA}/enwiki_wikiextractor_AB.txt.gz"]
HELD_OUT = ["benchmarks/dev_prompts.jsonl", "benchmarks/tune_prompts.jsonl", "benchmarks/bench_prompts.jsonl",
            "benchmarks/exactness_prompts.jsonl"]


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Extract a base's features (hidden states, top-k next-token "
                                "log-probabilities) over text for feature-level drafters; resumable.")
    p.add_argument("--base", default="smollm2-135m-instruct", help="a base alias, directory or Hub id")
    p.add_argument("--output", required=True, help="the features folder (resumed when it exists)")
    p.add_argument("--max-tokens", type=int, default=10_000_000)
    p.add_argument("--sources", nargs="+", default=DEFAULT_SOURCES)
    p.add_argument("--exclude", nargs="*", default=HELD_OUT, help="prompt files never trained on")
    p.add_argument("--layers", type=int, nargs="+", default=[-1], help="decoder layers to keep (-1: final, normed)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--shard-sequences", type=int, default=256)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16",
                   help="the forward's dtype (bf16: ~2.7x the tokens/s of fp32 on AVX-512 BF16 CPUs)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--idle", action="store_true", help="run at idle CPU priority (a background job)")
    args = p.parse_args(argv)
    if args.idle:
        from ..runtime.build_worker import idle_priority

        idle_priority()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from ..hub.base_models import load_base

    base, tokenizer = load_base(args.base, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    held_out = held_out_prompts([p for p in args.exclude if Path(p).exists()])
    manifest = extract_features(base, tokenizer, args.sources, args.output, args.max_tokens, held_out,
                                tuple(args.layers), args.top_k, args.max_length, args.batch_size,
                                args.shard_sequences, base_name=args.base)
    tokens = sum(s["tokens"] for s in manifest["shards"])
    print(f"{args.output}: {tokens} tokens in {len(manifest['shards'])} shards")
    return 0
