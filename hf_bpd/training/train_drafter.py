"""Training a feature-level drafter (`hf_bpd.feature_drafter`) on extracted base features
(`hf_bpd.training.features`).

Each sequence trains every position at once, teacher-forced at depth 1 and unrolled for the deeper ones (HASS): at
depth 1 the drafter reads the base's feature `f_i` and token i+1 and must give the base's next-token distribution
at i+1 (its k most likely tokens, renormalised: soft targets) while its hidden state regresses onto `f_{i+1}`; at
depth d > 1 it reads its own hidden state of depth d-1 in place of the base's feature, as when drafting. Reported
per depth: top-1 agreement, the share of positions where the drafter's most likely token is the base's.

    python training/train_drafter.py --features FEATURES --checkpoint checkpoints/smollm2-135m-instruct-bpd \
        --max-tokens 1000000 --output runs/drafter-1m
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..feature_drafter import FeatureDrafter
from .features import MANIFEST, read_manifest

logger = logging.getLogger(__name__)


def shard_files(folder: Path, held_out: int) -> tuple[list[dict], list[dict]]:
    """`(training shards, held-out shards)`: the last `held_out` shards of the extraction are never trained on."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder} holds no {MANIFEST}: extract features into it first (training/extract_features.py)")
    shards = manifest["shards"]
    if len(shards) <= held_out:
        raise ValueError(f"{folder} has {len(shards)} shards: extract more (or pass a smaller --held-out-shards)")
    return shards[:len(shards) - held_out], shards[len(shards) - held_out:]


def batches(folder: Path, shards: list[dict], max_tokens: int, batch_size: int) -> Iterator[dict]:
    """Batches of sequences from `shards`, in order, until `max_tokens` tokens were given."""
    given = 0
    for shard in shards:
        tensors = load_file(folder / shard["file"])
        for start in range(0, len(tensors["lengths"]), batch_size):
            if given >= max_tokens:
                return
            part = {k: v[start:start + batch_size] for k, v in tensors.items()}
            length = int(part["lengths"].max())
            part = {k: v[:, :length] if v.dim() >= 2 else v for k, v in part.items()}
            given += int(part["lengths"].sum())
            yield part


class DraftTargets:
    """Base top-k soft targets in draft-vocabulary indices (tokens outside the draft vocabulary dropped)."""

    def __init__(self, draft_vocab: torch.Tensor | None, vocab_size: int):
        self.index = None
        if draft_vocab is not None:
            self.index = torch.full((vocab_size,), -1, dtype=torch.long)
            self.index[draft_vocab] = torch.arange(len(draft_vocab))

    def __call__(self, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = top_ids.long() if self.index is None else self.index[top_ids.long()]
        valid = ids >= 0
        weights = torch.where(valid, top_logprobs.float().exp(), torch.zeros(()))
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
        return ids.clamp_min(0), weights


def drafter_loss(drafter: FeatureDrafter, batch: dict, targets: DraftTargets, depths: int = 2,
                 feature_weight: float = 0.1) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The batch's loss over `depths` drafting depths, and per depth `(agreeing positions, positions)`."""
    features = batch["hidden_-1"].to(drafter.fuse.weight.dtype)
    tokens = batch["input_ids"].long()
    lengths = batch["lengths"].long()
    n, length = tokens.shape
    positions = torch.arange(length)[None].expand(n, length)
    total, counts = torch.zeros(()), []
    state = features
    for depth in range(1, depths + 1):
        span = length - depth  # positions i whose target (at i + depth) is inside the sequence
        if span <= 0:
            break
        hidden = drafter(state[:, :span], tokens[:, depth:depth + span], positions[:, depth - 1:depth - 1 + span])
        valid = (positions[:, :span] + depth) < lengths[:, None]
        logits = drafter.logits(hidden).float()
        ids, weights = targets(batch["top_ids"][:, depth:depth + span], batch["top_logprobs"][:, depth:depth + span])
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids)
        ce = -(weights * logprobs).sum(-1)
        regress = nn.functional.smooth_l1_loss(hidden.float(), features[:, depth:depth + span].float(),
                                               reduction="none").mean(-1)
        loss = ((ce + feature_weight * regress) * valid).sum() / valid.sum().clamp_min(1)
        total = total + loss / depths
        guess = drafter.to_vocab_ids(logits.argmax(-1))
        agree = (guess == batch["top_ids"][:, depth:depth + span, 0].long()) & valid
        counts.append((int(agree.sum()), int(valid.sum())))
        state = hidden
    return total, counts


@torch.no_grad()
def evaluate(drafter, folder: Path, shards: list[dict], targets: DraftTargets, depths: int,
             max_tokens: int = 200_000, batch_size: int = 8) -> dict:
    """Loss and top-1 agreement per depth over held-out shards."""
    drafter.eval()
    losses, agree = [], [[0, 0] for _ in range(depths)]
    for batch in batches(folder, shards, max_tokens, batch_size):
        loss, counts = drafter_loss(drafter, batch, targets, depths)
        losses.append(float(loss))
        for d, (a, v) in enumerate(counts):
            agree[d][0] += a
            agree[d][1] += v
    drafter.train()
    return {"loss": sum(losses) / max(len(losses), 1),
            "agreement": [round(a / max(v, 1), 4) for a, v in agree]}


@torch.no_grad()
def heads_agreement(heads, folder: Path, shards: list[dict], depths: int, max_tokens: int = 200_000,
                    batch_size: int = 8) -> list[float]:
    """The same measure for independent drafting heads (`hf_bpd.heads.DraftHeads`) on the same held-out features:
    head d-1 reads the base's feature at i and predicts what the drafter predicts at depth d."""
    agree = [[0, 0] for _ in range(depths)]
    for batch in batches(folder, shards, max_tokens, batch_size):
        hidden = batch["hidden_-1"].to(next(heads.parameters()).dtype)
        lengths = batch["lengths"].long()
        length = hidden.shape[1]
        logits = heads(hidden, num_heads=min(depths, len(heads.heads)))  # (batch, heads, seq, draft)
        for d in range(1, logits.shape[1] + 1):
            span = length - d
            if span <= 0:
                break
            guess = heads.to_vocab_ids(logits[:, d - 1, :span].argmax(-1))
            valid = (torch.arange(span)[None] + d) < lengths[:, None]
            agree[d - 1][0] += int(((guess == batch["top_ids"][:, d:d + span, 0].long()) & valid).sum())
            agree[d - 1][1] += int(valid.sum())
    return [round(a / max(v, 1), 4) for a, v in agree]


def train(drafter: FeatureDrafter, folder: Path, max_tokens: int, depths: int = 2, batch_size: int = 8,
          lr: float = 5e-4, held_out_shards: int = 1, log_every: int = 50, bf16: bool = False) -> dict:
    """Train `drafter` on the first `max_tokens` tokens of the extraction in `folder` (the last `held_out_shards`
    shards held out); `bf16`: the forward and backward under CPU bfloat16 autocast (weights and optimizer in
    fp32)."""
    folder = Path(folder)
    train_shards, eval_shards = shard_files(folder, held_out_shards)
    vocab = drafter._frozen["embed"].weight.shape[0]
    targets = DraftTargets(drafter.draft_vocab, vocab)
    available = sum(s["tokens"] for s in train_shards)
    if available < max_tokens:
        raise ValueError(f"{folder} holds {available} training tokens, fewer than --max-tokens {max_tokens}: "
                         "extract more features first")
    mean_length = available / sum(s["sequences"] for s in train_shards)
    steps = math.ceil(max_tokens / (batch_size * mean_length))  # for the schedule: warm-up, then cosine to lr / 10
    warmup = max(1, min(100, steps // 20))
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(
        0.1, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    drafter.train()
    start, seen, step, history = time.perf_counter(), 0, 0, []
    agree = [[0, 0] for _ in range(depths)]
    for batch in batches(folder, train_shards, max_tokens, batch_size):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, counts = drafter_loss(drafter, batch, targets, depths)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        seen += int(batch["lengths"].sum())
        for d, (a, v) in enumerate(counts):
            agree[d][0] += a
            agree[d][1] += v
        if step % log_every == 0:
            rates = [round(a / max(v, 1), 3) for a, v in agree]
            logger.info("step %d, %d tokens, loss %.3f, top-1 agreement by depth %s, %.0f tokens/s", step, seen,
                        loss.item(), rates, seen / (time.perf_counter() - start))
            history.append({"step": step, "tokens": seen, "loss": round(loss.item(), 4), "agreement": rates})
            agree = [[0, 0] for _ in range(depths)]
    result = {"tokens": seen, "steps": step, "seconds": round(time.perf_counter() - start, 1),
              "held_out": evaluate(drafter, folder, eval_shards, targets, depths), "history": history}
    return result


def save_drafter(drafter: FeatureDrafter, output: Path, record: dict) -> None:
    output.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if v is not None}
    save_file(state, str(output / "drafter.safetensors"))
    (output / "training.json").write_text(json.dumps(record, indent=1))


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Train a feature-level drafter on extracted base features.")
    p.add_argument("--features", required=True, help="a folder written by training/extract_features.py")
    p.add_argument("--checkpoint", default="checkpoints/smollm2-135m-instruct-bpd",
                   help="the heads checkpoint whose base (and draft vocabulary) the drafter serves")
    p.add_argument("--max-tokens", type=int, default=1_000_000)
    p.add_argument("--depths", type=int, default=2, help="drafting depths trained (2: one unrolled step)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--held-out-shards", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="CPU bfloat16 autocast (AVX-512 BF16 / AMX CPUs)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from .. import BlockwiseParallelForCausalLM

    model = BlockwiseParallelForCausalLM.from_pretrained(args.checkpoint)
    base = model.base_lm
    for param in base.parameters():
        param.requires_grad_(False)
    drafter = FeatureDrafter(base, model.heads.draft_vocab)
    result = train(drafter, Path(args.features), args.max_tokens, args.depths, args.batch_size, args.lr,
                   args.held_out_shards, bf16=args.bf16)
    if model.config.head_type in ("ffn", "resblock"):  # the checkpoint's heads on the same held-out features
        _, held = shard_files(Path(args.features), args.held_out_shards)
        result["held_out"]["heads_agreement"] = heads_agreement(model.heads, Path(args.features), held,
                                                                args.depths)
    result["command"] = "python training/train_drafter.py " + " ".join(argv if argv is not None else sys.argv[1:])
    save_drafter(drafter, Path(args.output), result)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=1))
    return 0
