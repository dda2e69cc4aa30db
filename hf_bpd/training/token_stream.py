"""Pre-tokenised training streams: the sequence stream of `hf_bpd.training.features.sequence_stream` (its sources
interleaved round-robin, held-out prompts excluded) tokenised once and stored in one safetensors file, so that
training online on a GPU (`train_drafter.py --online --tokens FILE`) is bound by the GPU, not by the tokenizer and
the chat template.

| tensor | dtype | what |
| --- | --- | --- |
| `tokens` | uint16 (int32 when the vocabulary has over 65,536 ids) | every sequence's token ids, one after another |
| `offsets` | int64 | where each sequence starts in `tokens`, and (last) the total |

The file's metadata names the sources, the tokenizer's vocabulary size, the sequence length and the token count.

    python training/tokenize_sources.py --base smollm2-135m-instruct --sources A.jsonl.gz*3 B.json wiki.txt.gz \\
        --max-tokens 12000000 --output runs/stream.safetensors
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)


def write_stream(sequences: Iterator[list[int]], path: str | Path, max_tokens: int, vocab_size: int,
                 metadata: dict | None = None) -> dict:
    """Store `sequences` until `max_tokens` tokens (the last sequence whole); returns the file's metadata."""
    wide = vocab_size > 65536
    chunks, offsets, total, start = [], [0], 0, time.perf_counter()
    for seq in sequences:
        chunks.append(torch.tensor(seq, dtype=torch.int32))
        total += len(seq)
        offsets.append(total)
        if len(offsets) % 5000 == 0:
            logger.info("%d sequences, %d tokens, %.0f tokens/s", len(offsets) - 1, total,
                        total / (time.perf_counter() - start))
        if total >= max_tokens:
            break
    if not chunks:
        raise ValueError("the sources gave no sequences: pass files with conversations or text to --sources")
    tokens = torch.cat(chunks)
    if int(tokens.max()) >= vocab_size or int(tokens.min()) < 0:
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}: the tokenizer does not match the base")
    info = {**(metadata or {}), "vocab_size": vocab_size, "sequences": len(chunks), "tokens": total}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": tokens if wide else tokens.to(torch.uint16),
               "offsets": torch.tensor(offsets, dtype=torch.int64)}, str(path),
              metadata={k: json.dumps(v) for k, v in info.items()})
    return info


def read_metadata(path: str | Path) -> dict:
    with safe_open(str(path), "pt") as f:
        raw = f.metadata() or {}
        if "tokens" not in f.keys() or "offsets" not in f.keys():
            raise ValueError(f"{path} is not a token stream (no tokens/offsets): write one with "
                             "training/tokenize_sources.py")
    return {k: json.loads(v) for k, v in raw.items()}


def read_stream(path: str | Path, vocab_size: int | None = None) -> Iterator[list[int]]:
    """The stored sequences in order, as lists of ids (`vocab_size`: the base's; a stream tokenised for a larger
    vocabulary is refused)."""
    info = read_metadata(path)
    if vocab_size is not None and info.get("vocab_size", 0) > vocab_size:  # its ids may lie outside the base's
        raise ValueError(f"{path} was tokenised for a vocabulary of {info['vocab_size']} ids, the base has "
                         f"{vocab_size}: tokenise the sources with this base's tokenizer")
    with safe_open(str(path), "pt") as f:
        tokens, offsets = f.get_tensor("tokens").to(torch.int32), f.get_tensor("offsets").tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        yield tokens[start:end].tolist()


def main(argv=None) -> int:
    import argparse

    from ..hub.base_models import load_tokenizer
    from .data import held_out_prompts
    from .features import DEFAULT_SOURCES, HELD_OUT, sequence_stream

    p = argparse.ArgumentParser(description="Tokenise training sources once into a token stream for "
                                "train_drafter.py --online --tokens (sources interleaved round-robin).")
    p.add_argument("--base", default="smollm2-135m-instruct", help="the base whose tokenizer and chat template apply")
    p.add_argument("--sources", nargs="+", default=DEFAULT_SOURCES,
                   help="conversation files and wikiextractor text (PATH*N: N sequences per round)")
    p.add_argument("--exclude", nargs="*", default=HELD_OUT, help="prompt files never trained on")
    p.add_argument("--max-length", type=int, default=512, help="tokens per sequence at most")
    p.add_argument("--max-tokens", type=int, default=12_000_000)
    p.add_argument("--output", required=True, help="the .safetensors file to write")
    args = p.parse_args(argv)
    if args.max_tokens <= 0 or args.max_length < 8:
        p.error("--max-tokens must be positive and --max-length at least 8")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tokenizer = load_tokenizer(args.base)
    held_out = held_out_prompts([f for f in args.exclude if Path(f).exists()])
    stream = sequence_stream(args.sources, tokenizer, held_out, args.max_length)
    info = write_stream(stream, args.output, args.max_tokens, len(tokenizer),
                        {"base": args.base, "sources": args.sources, "max_length": args.max_length})
    print(f"{args.output}: {info['tokens']} tokens in {info['sequences']} sequences")
    return 0
