"""Training feature-level drafters (`hf_bpd.feature_drafter`), and drafting heads on the same data for comparison,
on base features: extracted ones (`hf_bpd.training.features`, `--features`) or computed on the fly (`--online`).

Each sequence trains every position at once, teacher-forced at depth 1 and unrolled for the deeper ones (HASS): at
depth 1 the drafter reads the base's feature `f_i` and token i+1 and must give the base's next-token distribution
at i+1 (its k most likely tokens, renormalised: soft targets) while its hidden state regresses onto `f_{i+1}` (for a
drafter with `feature_layers`, onto the fused feature it reads at i+1, held fixed); at
depth d > 1 it reads its own hidden state of depth d-1 in place of the base's feature, as when drafting. Heads
(`--heads`: fresh heads shaped like the checkpoint's) learn the same soft targets, head d from `f_i` alone. Several
token budgets (`--max-tokens 1000000 3000000 10000000`) train side by side on one pass over the data, each with its
own schedule: the points of a learning curve. Reported per depth: top-1 agreement, the share of positions where the
model's most likely token is the base's, on held-out sequences, and with `--dev-references` the block efficiency
of chain drafts along the base's greedy answers to the dev prompts (`hf_bpd.evaluation.drafter_quality`).

    python training/train_drafter.py --features FEATURES --checkpoint checkpoints/smollm2-135m-instruct-bpd \\
        --max-tokens 1000000 --output runs/drafter-1m
    python training/train_drafter.py --online --device cuda --checkpoint checkpoints/smollm2-135m-instruct-bpd \\
        --max-tokens 1000000 3000000 10000000 --heads --output runs/curve
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
from safetensors.torch import load_file
from torch import nn

from ..feature_drafter import FeatureDrafter
from .features import MANIFEST, read_manifest

logger = logging.getLogger(__name__)


def shard_files(folder: Path, held_out: int, layers=(-1,)) -> tuple[list[dict], list[dict]]:
    """`(training shards, held-out shards)`: the last `held_out` shards of the extraction are never trained on;
    the extraction must hold the hidden states of `layers` (what the drafters read)."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder} holds no {MANIFEST}: extract features into it first (training/extract_features.py)")
    missing = [i for i in layers if i not in manifest.get("layers", [-1])]
    if missing:
        raise ValueError(f"{folder} holds the hidden states of layers {manifest.get('layers', [-1])}, not {missing}: "
                         f"extract with --layers {' '.join(map(str, layers))}, or train other --feature-layers")
    shards = manifest["shards"]
    if len(shards) <= held_out:
        raise ValueError(f"{folder} has {len(shards)} shards: extract more (or pass a smaller --held-out-shards)")
    return shards[:len(shards) - held_out], shards[len(shards) - held_out:]


def batches(folder: Path, shards: list[dict], max_tokens: int, batch_size: int,
            device: torch.device | str = "cpu") -> Iterator[dict]:
    """Batches of sequences from `shards`, in order, until `max_tokens` tokens were given."""
    given = 0
    for shard in shards:
        tensors = load_file(folder / shard["file"])
        for start in range(0, len(tensors["lengths"]), batch_size):
            if given >= max_tokens:
                return
            part = {k: v[start:start + batch_size] for k, v in tensors.items()}
            length = int(part["lengths"].max())
            part = {k: (v[:, :length] if v.dim() >= 2 else v).to(device) for k, v in part.items()}
            given += int(part["lengths"].sum())
            yield part


class DraftTargets:
    """Base top-k soft targets in draft-vocabulary indices (tokens outside the draft vocabulary dropped)."""

    def __init__(self, draft_vocab: torch.Tensor | None, vocab_size: int):
        self.index = None
        if draft_vocab is not None:
            self.index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_vocab.device)
            self.index[draft_vocab] = torch.arange(len(draft_vocab), device=draft_vocab.device)

    def __call__(self, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index is not None and self.index.device != top_ids.device:
            self.index = self.index.to(top_ids.device)
        ids = top_ids.long() if self.index is None else self.index[top_ids.long()]
        valid = ids >= 0
        weights = torch.where(valid, top_logprobs.float().exp(), torch.zeros((), device=ids.device))
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
        return ids.clamp_min(0), weights


def _depth_terms(logits: torch.Tensor, batch: dict, targets: DraftTargets, depth: int, span: int,
                 to_vocab_ids) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Soft cross-entropy per position `(n, span)`, the valid-position mask, and `(agreeing, valid)` (0-d tensors) for
    the predictions `logits (n, span, draft)` of the base's next token at positions `depth .. depth + span - 1`."""
    lengths = batch["lengths"].long()
    valid = (torch.arange(span, device=logits.device)[None] + depth) < lengths[:, None]
    ids, weights = targets(batch["top_ids"][:, depth:depth + span], batch["top_logprobs"][:, depth:depth + span])
    ce = -(weights * torch.log_softmax(logits.float(), -1).gather(-1, ids)).sum(-1)
    guess = to_vocab_ids(logits.argmax(-1))
    agree = (guess == batch["top_ids"][:, depth:depth + span, 0].long()) & valid
    return ce, valid, (agree.sum(), valid.sum())  # tensors: no device sync per step


def drafter_loss(drafter: FeatureDrafter, batch: dict, targets: DraftTargets, depths: int = 2,
                 feature_weight: float = 0.1) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The batch's loss over `depths` drafting depths, and per depth `(agreeing positions, positions)`."""
    features = drafter.read_features(batch)  # the final feature, or it fused with lower layers' (feature_layers)
    wanted = features.detach()  # what the next depth's state stands in for: the feature read at the next position
    tokens = batch["input_ids"].long()
    n, length = tokens.shape
    positions = torch.arange(length, device=tokens.device)[None].expand(n, length)
    total, counts = torch.zeros((), device=tokens.device), []
    state = features
    for depth in range(1, depths + 1):
        span = length - depth  # positions i whose target (at i + depth) is inside the sequence
        if span <= 0:
            break
        hidden = drafter(state[:, :span], tokens[:, depth:depth + span], positions[:, depth - 1:depth - 1 + span])
        ce, valid, count = _depth_terms(drafter.logits(hidden), batch, targets, depth, span, drafter.to_vocab_ids)
        regress = nn.functional.smooth_l1_loss(hidden.float(), wanted[:, depth:depth + span].float(),
                                               reduction="none").mean(-1)
        total = total + ((ce + feature_weight * regress) * valid).sum() / valid.sum().clamp_min(1) / depths
        counts.append(count)
        state = hidden
    return total, counts


def heads_loss(heads, batch: dict, targets: DraftTargets, depths: int | None = None
               ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The same soft targets for independent drafting heads (`hf_bpd.heads.DraftHeads`): head d reads the base's
    feature at i alone and predicts what a drafter predicts at depth d."""
    features = batch["hidden_-1"].to(next(heads.parameters()).dtype)
    length = features.shape[1]
    n = len(heads.heads) if depths is None else min(depths, len(heads.heads))
    logits = heads(features, num_heads=n)  # (batch, heads, seq, draft)
    total, counts = torch.zeros((), device=features.device), []
    for depth in range(1, n + 1):
        span = length - depth
        if span <= 0:
            break
        ce, valid, count = _depth_terms(logits[:, depth - 1, :span], batch, targets, depth, span, heads.to_vocab_ids)
        total = total + (ce * valid).sum() / valid.sum().clamp_min(1) / n
        counts.append(count)
    return total, counts


class Trainee:
    """One model in training: its loss, its token budget, its optimizer and its schedule (linear warm-up over the
    first 2 % of the budget, then cosine to lr / 10, both in tokens)."""

    def __init__(self, name: str, module: nn.Module, loss, max_tokens: int, lr: float):
        self.name, self.module, self.loss, self.max_tokens, self.lr = name, module, loss, max_tokens, lr
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        self.seen = self.steps = 0
        self.history: list[dict] = []
        self.agree: list[list[int]] = []
        self.start = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.seen >= self.max_tokens

    def step(self, batch: dict, bf16: bool, tokens: int) -> torch.Tensor:
        """One optimizer step on `batch` of `tokens` tokens; the loss, on the batch's device."""
        progress = self.seen / self.max_tokens
        scale = min(1.0, (progress + 1e-9) / 0.02) * max(0.1, 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * scale
        device = batch["input_ids"].device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss, counts = self.loss(self.module, batch)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.steps += 1
        self.seen += tokens
        self.agree += [[0, 0] for _ in range(len(counts) - len(self.agree))]
        for d, (a, v) in enumerate(counts):
            self.agree[d][0] += a
            self.agree[d][1] += v
        return loss.detach()

    def log(self, loss) -> None:
        loss = float(loss)
        rates = [round(int(a) / max(int(v), 1), 3) for a, v in self.agree]
        logger.info("%s: step %d, %d tokens, loss %.3f, top-1 agreement by depth %s, %.0f tokens/s", self.name,
                    self.steps, self.seen, loss, rates, self.seen / (time.perf_counter() - self.start))
        self.history.append({"step": self.steps, "tokens": self.seen, "loss": round(loss, 4), "agreement": rates})
        self.agree = []

    def record(self) -> dict:
        return {"tokens": self.seen, "budget": self.max_tokens, "steps": self.steps,
                "seconds": round(time.perf_counter() - self.start, 1), "history": self.history}


@torch.no_grad()
def evaluate(module: nn.Module, loss, held_out: list[dict]) -> dict:
    """Loss and top-1 agreement per depth over held-out batches."""
    module.eval()
    losses, agree = [], []
    for batch in held_out:
        value, counts = loss(module, batch)
        losses.append(float(value))
        agree += [[0, 0] for _ in range(len(counts) - len(agree))]
        for d, (a, v) in enumerate(counts):
            agree[d][0] += int(a)
            agree[d][1] += int(v)
    module.train()
    return {"loss": sum(losses) / max(len(losses), 1), "agreement": [round(a / max(v, 1), 4) for a, v in agree]}


def train_side_by_side(trainees: list[Trainee], data: Iterator[dict], bf16: bool = False, log_every: int = 50,
                       max_seconds: float | None = None, on_done=None) -> None:
    """Each batch of `data` trains every trainee whose budget is not spent; `on_done(trainee)` runs as a budget is
    reached (or for every unfinished trainee when `max_seconds` runs out or the data ends)."""
    start, pending = time.perf_counter(), list(trainees)
    for batch in data:
        tokens = int(batch["lengths"].sum())
        for trainee in list(pending):
            loss = trainee.step(batch, bf16, tokens)
            if trainee.steps % log_every == 0:
                trainee.log(loss)
            if trainee.done:
                pending.remove(trainee)
                if on_done:
                    on_done(trainee)
        if not pending:
            return
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            logger.info("--max-seconds %s reached: stopping %s", max_seconds, ", ".join(t.name for t in pending))
            break
    for trainee in pending:
        if on_done:
            on_done(trainee)


def train(drafter: FeatureDrafter, folder: Path, max_tokens: int, depths: int = 2, batch_size: int = 8,
          lr: float = 5e-4, held_out_shards: int = 1, log_every: int = 50, bf16: bool = False) -> dict:
    """Train `drafter` on the first `max_tokens` tokens of the extraction in `folder` (the last `held_out_shards`
    shards held out); `bf16`: the forward and backward under bfloat16 autocast (weights and optimizer in fp32)."""
    folder = Path(folder)
    train_shards, eval_shards = shard_files(folder, held_out_shards, drafter.layers_read())
    available = sum(s["tokens"] for s in train_shards)
    if available < max_tokens:
        raise ValueError(f"{folder} holds {available} training tokens, fewer than --max-tokens {max_tokens}: "
                         "extract more features first")
    targets = DraftTargets(drafter.draft_vocab, drafter._frozen["embed"].weight.shape[0])
    trainee = Trainee("drafter", drafter, lambda m, b: drafter_loss(m, b, targets, depths), max_tokens, lr)
    drafter.train()
    train_side_by_side([trainee], batches(folder, train_shards, max_tokens, batch_size), bf16, log_every)
    held_out = list(batches(folder, eval_shards, 200_000, 8))
    return {**trainee.record(), "held_out": evaluate(drafter, trainee.loss, held_out)}


def save_drafter(drafter: FeatureDrafter, output: Path, record: dict, dtype: torch.dtype | None = None) -> None:
    """`drafter.safetensors` (its weights, in `dtype` when given) and `training.json` in `output`."""
    drafter.save(output, dtype)
    (output / "training.json").write_text(json.dumps(record, indent=1))


def parse_args(argv=None):
    import argparse

    from .features import DEFAULT_SOURCES, HELD_OUT

    p = argparse.ArgumentParser(description="Train feature-level drafters (and, for comparison, drafting heads) on "
                                "base features: extracted (--features) or computed on the fly (--online).")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--features", help="a folder written by training/extract_features.py")
    data.add_argument("--online", action="store_true", help="compute the base's features while training, from "
                      "--sources (no features stored; fast on a GPU)")
    p.add_argument("--sources", nargs="+", default=DEFAULT_SOURCES,
                   help="with --online: text sources as for extract_features.py (PATH*N: N sequences per round)")
    p.add_argument("--tokens", default=None, help="with --online: a token stream written by "
                   "training/tokenize_sources.py, in place of --sources (no tokenizer work while training)")
    p.add_argument("--exclude", nargs="*", default=HELD_OUT, help="with --online: prompt files never trained on")
    p.add_argument("--max-length", type=int, default=512, help="with --online: tokens per sequence at most")
    p.add_argument("--held-out-sequences", type=int, default=256,
                   help="with --online: the stream's first sequences, held out for the agreement report")
    p.add_argument("--checkpoint", default="checkpoints/smollm2-135m-instruct-bpd",
                   help="the heads checkpoint whose base and draft vocabulary the drafter serves (and whose heads' "
                        "shape --heads trains)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[1_000_000],
                   help="training-token budgets, each trained side by side on one pass (a learning curve)")
    p.add_argument("--feature-layers", nargs="+", default=["none"], metavar="SPEC",
                   help="drafters trained side by side at every budget: 'none' (the final feature alone) or the "
                        "lower decoder layers fused with it, comma-separated (e.g. 2,15: EAGLE-3's fused features)")
    p.add_argument("--heads", action="store_true", help="also train fresh heads shaped like the checkpoint's on the "
                   "same batches, at every budget")
    p.add_argument("--depths", type=int, default=2, help="drafting depths trained (2: one unrolled step)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--heads-lr", type=float, default=1e-3)
    p.add_argument("--held-out-shards", type=int, default=1, help="with --features: shards never trained on")
    p.add_argument("--dev-references", default=None, help="a references JSONL of benchmarks/draft_quality.py: report "
                   "each model's chain block efficiency along those greedy answers")
    p.add_argument("--dev-depth", type=int, default=4, help="the drafters' chain length for --dev-references")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (a GPU, or AVX-512 BF16 / AMX CPUs)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... or auto")
    p.add_argument("--max-seconds", type=float, default=None, help="stop training after this long; every model "
                   "is saved with the tokens it saw")
    p.add_argument("--save-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--ignore-fingerprint-mismatch", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    if args.device != "cpu" and not torch.accelerator.is_available():
        p.error(f"--device {args.device}: no accelerator on this machine (use cpu, or auto)")
    if args.tokens and not args.online:
        p.error("--tokens goes with --online (it replaces --sources)")
    if args.tokens and not Path(args.tokens).is_file():
        p.error(f"--tokens {args.tokens}: no such file (write one with training/tokenize_sources.py)")
    if min(args.max_tokens) <= 0:
        p.error("--max-tokens: budgets must be positive")
    try:
        args.feature_layers = [[] if spec == "none" else [int(i) for i in spec.split(",")]
                               for spec in args.feature_layers]
    except ValueError:
        p.error(f"--feature-layers {' '.join(args.feature_layers)}: each is 'none' or layer numbers joined by commas "
                "(2,15)")
    return args


def layers_needed(args) -> list[int]:
    """The base layers the trained drafters read: -1 (the final feature), then every fused layer."""
    return [-1] + sorted({i for spec in args.feature_layers for i in spec})


def _trainees(args, base, draft_vocab, heads_config, vocab_size) -> list[Trainee]:
    from .. import BlockwiseParallelForCausalLM

    targets = DraftTargets(draft_vocab, vocab_size)
    trainees = []
    for budget in sorted(args.max_tokens):
        for spec in args.feature_layers:
            drafter = FeatureDrafter(base, draft_vocab, spec).to(args.device)
            name = "drafter-" + ("l" + ".".join(map(str, spec)) + "-" if spec else "") + _size(budget)
            trainees.append(Trainee(name, drafter, lambda m, b: drafter_loss(m, b, targets, args.depths), budget,
                                    args.lr))
        if args.heads:
            shape = {k: getattr(heads_config, k) for k in ("num_heads", "head_type", "num_layers_per_head",
                                                          "head_intermediate_size", "tie_head_projection")}
            model = BlockwiseParallelForCausalLM.from_base(base, draft_vocab=draft_vocab.tolist(), **shape)
            model.config.base_model_name_or_path = heads_config.base_model_name_or_path
            model.heads.to(args.device).train()
            trainee = Trainee(f"heads-{_size(budget)}", model.heads,
                              lambda m, b: heads_loss(m, b, targets), budget, args.heads_lr)
            trainee.checkpoint = model
            trainees.append(trainee)
    return trainees


def _size(tokens: int) -> str:
    return f"{tokens / 1e6:g}m" if tokens >= 1_000_000 else f"{tokens / 1e3:g}k"


def main(argv=None) -> int:
    from safetensors import safe_open

    from ..hub.base_models import check_fingerprint, load_base
    from ..hub.bundled import load_heads_config
    from .data import held_out_prompts
    from .features import online_batches, sequence_stream
    from .token_stream import read_metadata, read_stream

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    checkpoint = Path(args.checkpoint)
    heads_config = load_heads_config(checkpoint)
    with safe_open(str(checkpoint / "heads.safetensors"), "pt") as f:
        draft_vocab = f.get_tensor("draft_vocab") if "draft_vocab" in f.keys() else None
        has_heads = any(k != "draft_vocab" for k in f.keys())
    base, tokenizer = load_base(heads_config.base_model_name_or_path)
    check_fingerprint(base, heads_config.base_model_fingerprint, checkpoint, args.ignore_fingerprint_mismatch)
    base.requires_grad_(False)
    reference = None  # the checkpoint's own heads, measured on the same held-out data
    if has_heads and heads_config.head_type in ("ffn", "resblock"):
        from .. import BlockwiseParallelForCausalLM

        reference = BlockwiseParallelForCausalLM.from_pretrained(
            checkpoint, base_model=base, ignore_fingerprint_mismatch=args.ignore_fingerprint_mismatch).heads
    base.to(args.device)
    draft_vocab = None if draft_vocab is None else draft_vocab.to(args.device)
    if args.online:
        if args.tokens:
            stream = read_stream(args.tokens, base.config.vocab_size)
        else:
            held = held_out_prompts([p for p in args.exclude if Path(p).exists()])
            stream = sequence_stream(args.sources, tokenizer, held, args.max_length)
        layers = layers_needed(args)
        held_out = list(online_batches(base, iter([next(stream) for _ in range(args.held_out_sequences)]),
                                       float("inf"), args.batch_size, pool=args.held_out_sequences, layers=layers))
        data = online_batches(base, stream, max(args.max_tokens), args.batch_size, seed=args.seed, layers=layers)
    else:
        folder = Path(args.features)
        train_shards, eval_shards = shard_files(folder, args.held_out_shards, layers_needed(args))
        held_out = list(batches(folder, eval_shards, 200_000, 8, args.device))
        data = batches(folder, train_shards, max(args.max_tokens), args.batch_size, args.device)
    trainees = _trainees(args, base, draft_vocab, heads_config, base.config.vocab_size)
    along = []
    if args.dev_references:
        from ..evaluation import drafter_quality

        along = [(ids, n, drafter_quality.base_features(base, ids, layers_needed(args))) for ids, n in
                 drafter_quality.read_references(args.dev_references)]
    if args.tokens:
        info = read_metadata(args.tokens)
        data_description = (f"online, the token stream {args.tokens} ({info.get('tokens')} tokens, "
                            f"{info.get('sequences')} sequences of at most {info.get('max_length')}) of: "
                            + " ".join(info.get("sources", [])))
    else:
        data_description = "online: " + " ".join(args.sources) if args.online else args.features
    command = "python training/train_drafter.py " + " ".join(argv if argv is not None else sys.argv[1:])
    output = Path(args.output)
    results = {}
    if reference is not None:
        from ..evaluation import drafter_quality

        reference.to(args.device).eval()
        targets = DraftTargets(reference.draft_vocab, base.config.vocab_size)
        results["checkpoint_heads"] = {"held_out": evaluate(reference, lambda m, b: heads_loss(
            m, b, targets, args.depths), held_out)}
        if along:
            results["checkpoint_heads"]["dev_chain_block_efficiency"] = round(
                drafter_quality.chain_block_efficiency(reference, along), 4)
        logger.info("the checkpoint's heads: %s", json.dumps(results["checkpoint_heads"]))

    def finish(trainee: Trainee) -> None:
        record = {**trainee.record(), "held_out": evaluate(trainee.module, trainee.loss, held_out),
                  "command": command, "data": data_description}
        if reference is not None and not hasattr(trainee, "checkpoint"):
            record["held_out"]["heads_agreement"] = results["checkpoint_heads"]["held_out"]["agreement"]
        if along:
            from ..evaluation import drafter_quality

            trainee.module.eval()
            record["dev_chain_block_efficiency"] = round(drafter_quality.chain_block_efficiency(
                trainee.module, along, args.dev_depth), 4)
            if not hasattr(trainee, "checkpoint"):  # a full tree of its top 4 at every depth: a tree's upper bound
                record["dev_top4_block_efficiency"] = round(drafter_quality.chain_block_efficiency(
                    trainee.module, along, args.dev_depth, top_k=4), 4)
        folder = output if len(trainees) == 1 else output / trainee.name
        if hasattr(trainee, "checkpoint"):
            if args.save_dtype == "bf16":
                trainee.module.to(torch.bfloat16)
            trainee.checkpoint.save_pretrained(folder)
            (folder / "training.json").write_text(json.dumps(record, indent=1))
        else:
            save_drafter(trainee.module, folder, record, torch.bfloat16 if args.save_dtype == "bf16" else None)
        results[trainee.name] = {k: v for k, v in record.items() if k not in ("history", "command")}
        logger.info("%s saved in %s: %s", trainee.name, folder, json.dumps(results[trainee.name]))
        trainee.module.to("cpu")  # its memory back for the others

    train_side_by_side(trainees, data, args.bf16, max_seconds=args.max_seconds, on_done=finish)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
