"""Training pieces for drafting heads: examples, cached base hidden states, draft vocabulary, metrics.

With a frozen base (Medusa-1, the paper's setting) the base's last hidden states are computed once and cached, and
the heads train on them: a step then costs only the heads, which on CPU is what makes training affordable. With LoRA
in the base (Medusa-2) the whole model runs every step (`BlockwiseParallelForCausalLM.forward(labels=...)`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from .data import conversation_messages, tokenize_conversation

logger = logging.getLogger(__name__)


def build_examples(tokenizer, records, max_length: int = 1024) -> tuple[list[dict], int]:
    """Chat-template examples (assistant-only labels) from ShareGPT/Alpaca records; returns `(examples, skipped)`.

    Malformed records (no usable turns, nothing for the assistant to learn) are skipped and counted, not fatal.
    """
    examples, skipped = [], 0
    for record in records:
        try:
            messages = conversation_messages(record)
            if not any(m["role"] == "assistant" and m["content"] for m in messages):
                raise ValueError("no assistant turn")
            example = tokenize_conversation(tokenizer, messages, max_length)
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        if sum(label != -100 for label in example["labels"]) < 2:
            skipped += 1
            continue
        examples.append(example)
    if skipped:
        logger.warning("skipped %d malformed or empty records", skipped)
    return examples, skipped


def choose_draft_vocab(examples: list[dict], size: int, always: list[int] = ()) -> list[int]:
    """The `size` most frequent label tokens (plus `always`, e.g. EOS): what the heads will score over.

    When the data has fewer distinct tokens, the lowest unused ids fill the vocabulary up to `size`."""
    counts = Counter(t for ex in examples for t in ex["labels"] if t != -100)
    vocab = list(dict.fromkeys(list(always) + [t for t, _ in counts.most_common(size)]))[:size]
    filler = (i for i in range(size + len(vocab)) if i not in set(vocab))
    return sorted(vocab + [next(filler) for _ in range(size - len(vocab))])


@torch.no_grad()
def cache_hidden_states(model, examples: list[dict], batch_tokens: int = 4096, dtype=torch.bfloat16,
                        targets: str = "data", cache_dir=None, shard_examples: int = 512) -> list[dict]:
    """Run the frozen base once over every example; keep `(hidden (seq, d), labels (seq,))` per example.

    `targets="base"` replaces every trainable label by the base's own greedy prediction of that token (the argmax
    of the previous position's logits, from the same forward pass): teacher-forced self-distillation, so the heads
    learn what *the base* would say next along the data, at no generation cost. `targets="data"` keeps the text.

    `cache_dir`: keep the results on disk (safetensors shards) keyed per example by the base (config and weights
    checksum), `targets`, `dtype` and the example's tokens and labels, and reuse them: head variants train without
    running the base again, and data added later (or another split of the same data) costs base forwards only for
    the examples not seen before. Shards are written every `shard_examples` computed examples.
    """
    if cache_dir is None:
        return _compute_hidden_states(model, examples, batch_tokens, dtype, targets)
    cache_dir = Path(cache_dir)
    prefix = _base_key(model, targets, dtype)
    keys = [_example_key(prefix, example) for example in examples]
    found = _load_cached(cache_dir, prefix, set(keys))
    todo = {}  # key -> example, identical examples computed once
    for key, example in zip(keys, examples):
        if key not in found:
            todo.setdefault(key, example)
    logger.info("hidden states: %d examples from %s, %d to compute", sum(k in found for k in keys), cache_dir,
                len(todo))
    pending = list(todo.items())
    for start in range(0, len(pending), shard_examples):  # a shard per chunk: a killed run keeps what it computed
        chunk = dict(pending[start: start + shard_examples])
        computed = _compute_hidden_states(model, list(chunk.values()), batch_tokens, dtype, targets)
        new = dict(zip(chunk, computed))
        _save_shard(cache_dir, prefix, new)
        found.update(new)
    return [found[key] for key in keys]


def _compute_hidden_states(model, examples, batch_tokens, dtype, targets) -> list[dict]:
    cached = []
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    batches, batch = [], []
    for i in order:
        batch.append(i)
        if len(batch) * len(examples[i]["input_ids"]) >= batch_tokens:
            batches.append(batch)
            batch = []
    if batch:
        batches.append(batch)
    results = {}
    for batch in tqdm(batches, desc="caching base hidden states", unit="batch"):
        width = max(len(examples[i]["input_ids"]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            n = len(examples[i]["input_ids"])
            ids[row, :n] = torch.tensor(examples[i]["input_ids"])
            mask[row, :n] = 1
        out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), return_head_logits=False)
        hidden = out.last_hidden_state
        for row, i in enumerate(batch):
            n = len(examples[i]["input_ids"])
            labels = torch.tensor(examples[i]["labels"])
            if targets == "base":
                predicted = out.logits[row, : n - 1].argmax(-1).cpu()
                labels[1:] = torch.where(labels[1:] != -100, predicted, labels[1:])
            results[i] = {"hidden": hidden[row, :n].to(dtype).cpu(), "labels": labels}
    for i in range(len(examples)):
        cached.append(results[i])
    return cached


def _base_key(model, targets: str, dtype) -> str:
    digest = hashlib.sha256()
    base = model.base_lm if hasattr(model, "base_lm") else model
    digest.update(base.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():  # a cheap checksum of the weights: another checkpoint of the same config differs here
        for name, tensor in sorted(base.state_dict().items()):
            flat = tensor.detach().flatten()
            sample = flat[:: max(1, flat.numel() // 64)].float()  # sample first: no float copy of every weight
            digest.update(f"{name}:{tuple(tensor.shape)}:{sample.tolist()}".encode())
    digest.update(f"{targets}:{dtype}".encode())
    return digest.hexdigest()[:16]


def _example_key(prefix: str, example: dict) -> str:
    digest = hashlib.sha256(prefix.encode())
    digest.update(torch.tensor(example["input_ids"], dtype=torch.int64).numpy().tobytes())
    digest.update(b"|")
    digest.update(torch.tensor(example["labels"], dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()[:24]


def _save_shard(cache_dir: Path, prefix: str, entries: dict[str, dict]) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, entry in entries.items():
        tensors[f"{key}.hidden"] = entry["hidden"].contiguous()
        tensors[f"{key}.labels"] = entry["labels"].contiguous()
    name = hashlib.sha256("".join(sorted(entries)).encode()).hexdigest()[:16]
    path = cache_dir / f"hidden-{prefix}-{name}.safetensors"
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # two processes writing one shard never mix
    save_file(tensors, str(partial))
    os.replace(partial, path)  # a kill mid-write never leaves a shard that looks complete


def _load_cached(cache_dir: Path, prefix: str, wanted: set[str]) -> dict[str, dict]:
    found = {}
    for path in sorted(cache_dir.glob(f"hidden-{prefix}-*.safetensors")):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                key, _, kind = name.partition(".")
                if key in wanted and kind == "hidden" and key not in found:
                    found[key] = {"hidden": shard.get_tensor(name), "labels": shard.get_tensor(f"{key}.labels")}
    return found


def collate_cached(items: list[dict]) -> dict:
    width = max(len(it["labels"]) for it in items)
    d = items[0]["hidden"].shape[-1]
    hidden = torch.zeros(len(items), width, d, dtype=items[0]["hidden"].dtype)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for row, it in enumerate(items):
        n = len(it["labels"])
        hidden[row, :n] = it["hidden"]
        labels[row, :n] = it["labels"]
    return {"hidden": hidden, "labels": labels}


class HeadsOnHiddenStates(nn.Module):
    """Trains `model.heads` on cached base hidden states: `forward(hidden, labels)` -> BPD loss (App. C.1).

    Head `i` (0-based) at position `t` is trained on `labels[t + 2 + i]`; losses are weighted by the config's λ_h.
    `soft_weight` / `temperature`: soft targets (the base's distribution at `t + 1 + i`, see `DraftHeads.loss`).
    """

    def __init__(self, model, soft_weight: float = 0.0, temperature: float = 1.0):
        super().__init__()
        self.heads = model.heads
        self.weights = list(model.config.head_loss_weights)
        self.soft_weight, self.temperature = soft_weight, temperature

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, return_stats: bool = False):
        weight = next(self.heads.parameters())  # the cache lives on CPU, the heads where accelerate put them
        hidden, labels = hidden.to(weight.device, weight.dtype), labels.to(weight.device)
        return self.heads.loss(hidden, labels, self.weights, return_stats=return_stats,
                               soft_weight=self.soft_weight, temperature=self.temperature)


@torch.no_grad()
def head_accuracy(trainer_module: HeadsOnHiddenStates, cached: list[dict], batch_size: int = 8) -> list[dict]:
    """Per-head top-1 / top-5 accuracy (and count) on cached held-out examples."""
    totals = None
    for start in range(0, len(cached), batch_size):
        batch = collate_cached(cached[start: start + batch_size])
        _, _, stats = trainer_module(batch["hidden"], batch["labels"], return_stats=True)
        totals = stats if totals is None else [tuple(a + b for a, b in zip(x, y)) for x, y in zip(totals, stats)]
    return [{"head": i + 1, "positions": n, "top1": c1 / max(n, 1), "top5": c5 / max(n, 1)}
            for i, (n, c1, c5) in enumerate(totals or [])]


# --- crash-safe `accelerator.save_state` checkpoints -------------------------------------------------------------
# `accelerator.save_state` writes its files in place, so a kill during a save leaves a directory whose files are half
# written next to the previous save's trainer_state.json. A save therefore goes to `<dir>.partial`; only when every
# file and trainer_state.json (written last) are on disk is it swapped in for `<dir>` (the previous save is parked in
# `<dir>.old` during the two renames). Resuming takes the newest complete one of the three.

def _checkpoint_dirs(state_dir: Path) -> tuple[Path, Path, Path]:
    return state_dir, state_dir.with_name(state_dir.name + ".partial"), state_dir.with_name(state_dir.name + ".old")


def save_checkpoint(accelerator, state_dir, step: int) -> None:
    """`accelerator.save_state` to `state_dir` such that a kill at any moment leaves a complete checkpoint."""
    state_dir = Path(state_dir)
    current, partial, old = _checkpoint_dirs(state_dir)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_synced(partial / "trainer_state.json", json.dumps({"step": step}))
        if current.exists():
            if old.exists():
                shutil.rmtree(old)
            current.rename(old)
        partial.rename(current)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def latest_checkpoint(state_dir) -> tuple[Path, int] | None:
    """The newest complete checkpoint saved by `save_checkpoint` (directory, step), or None."""
    found = []
    for directory in _checkpoint_dirs(Path(state_dir)):
        marker = directory / "trainer_state.json"
        try:
            found.append((json.loads(marker.read_text())["step"], directory))
        except (OSError, ValueError, KeyError):
            continue
    if not found:
        return None
    step, directory = max(found, key=lambda item: item[0])
    return directory, step


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
