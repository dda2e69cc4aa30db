"""Train BPD drafting heads with Accelerate, and optionally LoRA in the base through peft (usage and options:
`hf_bpd.training.arguments`).

Several processes (`accelerate launch --multi_gpu --num_processes N`, `--config_file configs/...`, or `torchrun`) train
data-parallel, on GPUs or, on a machine without any, on CPU over gloo. They give the run one process would give:
`--batch-size` is the global batch of a step, every process collates its share of it, and each process's loss is
weighted by its share of the step's scored positions, so the averaged gradient is the gradient of the global batch's
loss (exactly so for the heads in frozen-base mode; by token count with `--lora-base`).
"""

import json
import math
import os
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader, Sampler

import hf_bpd
from .arguments import parse_args
from .lora import save_base_adapter
from .hidden_states import (HeadsOnHiddenStates, build_examples, cache_hidden_states,
                             choose_draft_vocab, collate_cached, head_accuracy, latest_checkpoint,
                             save_checkpoint)


def keep_log_until(path: Path, step: int) -> None:
    """Drop train_log.jsonl entries after `step` (and a line torn by a kill)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(line + "\n" for line in kept))


class EpochBatches(Sampler):
    """Deterministic shuffled batches of one epoch: the order of epoch e depends only on (seed, e), so a resumed run
    sees exactly the batches the killed run would have seen. `use_epoch(e, skip)` selects the epoch and skips its
    first `skip` batches (without loading them). Every process iterates the same (global) batches."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed, self.epoch, self.skip = n, batch_size, seed, 0, 0

    def use_epoch(self, epoch: int, skip: int = 0) -> None:  # not `set_epoch`: accelerate would reset it per iterator
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for i in range(self.skip * self.batch_size, self.n, self.batch_size):
            yield order[i: i + self.batch_size]

    def __len__(self):
        return math.ceil(self.n / self.batch_size)


def load_records(files):
    records = []
    for f in files:
        records.extend(load_dataset("json", data_files=f, split="train"))
    return records


def collate_tokens(pad_id):
    def collate(items):
        width = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        labels = torch.full((len(items), width), -100, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, it in enumerate(items):
            n = len(it["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(it["input_ids"]), torch.tensor(
                it["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return collate


def process_share(collate, index: int, count: int):
    """`collate` of process `index`'s share (every `count`-th example) of a global batch. A process whose share is
    empty (a last batch smaller than `count`) collates the batch's first example instead, and `"scored"` is False:
    it runs the step (data parallelism needs every process in every step) but its loss counts for nothing."""
    def collate_share(items):
        mine = items[index::count]
        return {**collate(mine or items[:1]), "scored": bool(mine)}
    return collate_share


def share_of_positions(accelerator, positions: list[int], scored: bool, device) -> torch.Tensor:
    """This process's share (terms,) of each loss term's scored positions in the global batch (summed over processes:
    1, or 0 where no process scored any). A term's per-process mean times this share, summed over the processes, is
    the term's mean over the global batch: what one process training on the whole batch computes."""
    positions = torch.tensor(positions, dtype=torch.float32, device=device) * scored
    return positions / accelerator.reduce(positions, "sum").clamp(min=1)


def cpu_only_processes() -> bool:
    """Several processes (`accelerate launch --multi_gpu`, `torchrun`) on a machine with no accelerator: Accelerate
    makes them data-parallel over gloo only when told they run on CPU; otherwise each would train alone."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()


def cached_hidden_states(accelerator, model, examples, args) -> list[dict]:
    """`cache_hidden_states` with several processes: with `--cache-dir`, each process runs the base on its share of
    the examples and writes its own shards (disjoint, so no two write the same file), then all read the whole cache
    (a file system every process sees); without one, every process runs the base on every example."""
    if args.cache_dir and accelerator.num_processes > 1:
        share = examples[accelerator.process_index:: accelerator.num_processes]
        cache_hidden_states(model, share, targets=args.targets, cache_dir=args.cache_dir)
        accelerator.wait_for_everyone()
    return cache_hidden_states(model, examples, targets=args.targets, cache_dir=args.cache_dir)


def main(argv=None, prog=None):
    args = parse_args(argv, prog)
    missing = [f for f in args.data if not os.path.isfile(f)]
    if missing:  # before any model or dataset is loaded
        raise SystemExit(f"train_heads: --data: no file {missing[0]}: pass existing ShareGPT/Alpaca JSON or JSONL "
                         "files")
    if not 0.0 <= args.soft_target_weight <= 1.0 or args.soft_target_temperature <= 0:
        raise SystemExit("train_heads: --soft-target-weight must be in [0, 1] and --soft-target-temperature > 0")
    if args.soft_target_weight > 0 and args.lora_base:
        raise SystemExit("train_heads: --soft-target-weight needs the frozen-base mode (drop --lora-base)")
    if args.threads:
        torch.set_num_threads(args.threads)
    # split_batches: --batch-size is the global batch (the scheduler steps once per step, not once per process);
    # find_unused_parameters: a head with no scored position in a process's share is not in its graph
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"train_heads: --device cuda: torch {torch.__version__} sees no CUDA device here: use "
                         "--device cpu (or auto)")
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum,
                              cpu=args.device == "cpu" or cpu_only_processes(),
                              dataloader_config=DataLoaderConfiguration(split_batches=True),
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    parallel = accelerator.num_processes > 1
    set_seed(args.seed)
    out = Path(args.output_dir)
    log = (lambda msg: accelerator.print(msg, flush=True))
    started = time.perf_counter()
    if (os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") and "MASTER_PORT" in os.environ
            and "WORLD_SIZE" not in os.environ):  # what `accelerate launch --cpu --num_processes 2` leaves
        log("one process: `accelerate launch --cpu --num_processes N` starts only one (several need mpirun); for N "
            "CPU processes use `accelerate launch --multi_gpu --num_processes N` or --config_file configs/cpu.yaml")

    with accelerator.main_process_first():  # a packaged base is converted, and the data cached, by one process
        base, tokenizer = hf_bpd.load_base(args.model, dtype=getattr(torch, args.dtype))
        records = load_records(args.data)
    examples, skipped = build_examples(tokenizer, records, args.max_length)
    examples = examples[: args.max_examples]
    if not examples:
        raise SystemExit("train_heads: no usable training examples in --data (need assistant turns)")
    n_eval = max(1, int(len(examples) * args.eval_fraction)) if len(examples) > 1 else 0
    generator = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(examples), generator=generator).tolist()
    eval_examples = [examples[i] for i in perm[:n_eval]]
    train_examples = [examples[i] for i in perm[n_eval:]]
    log(f"{len(train_examples)} training / {len(eval_examples)} eval examples ({skipped} records skipped), "
        f"{sum(len(e['input_ids']) for e in train_examples)} training tokens")

    if args.init_from:
        model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.init_from, base_model=base)
    else:
        draft_vocab = None
        if args.draft_vocab_size:
            specials = [t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None]
            draft_vocab = choose_draft_vocab(train_examples, args.draft_vocab_size, specials)
        weights = [float(w) for w in args.head_loss_weights.split(",")] if args.head_loss_weights else None
        model = hf_bpd.BlockwiseParallelForCausalLM.from_base(
            base, num_heads=args.num_heads, head_type=args.head_type, num_layers_per_head=args.num_layers_per_head,
            head_intermediate_size=args.head_intermediate_size,
            tie_head_projection=not args.own_projection, draft_vocab=draft_vocab, head_loss_weights=weights)
        model.config.base_model_name_or_path = args.model

    model.to(accelerator.device)
    lora = args.lora_base is not None
    if lora:
        from peft import get_peft_model

        model.freeze_base()
        trainable = get_peft_model(model, hf_bpd.bpd_lora_config(model, r=args.lora_r, heads="full",
                                                                 base_target_modules=args.lora_base.split(",")))
        dataset, eval_data = train_examples, eval_examples
        collate = collate_tokens(tokenizer.pad_token_id or 0)
    else:
        model.freeze_base()
        if parallel and not args.cache_dir:
            log(f"each of the {accelerator.num_processes} processes runs the base over every example: pass "
                "--cache-dir to share that work")
        dataset = cached_hidden_states(accelerator, model, train_examples, args)
        eval_data = (cache_hidden_states(model, eval_examples, targets=args.targets, cache_dir=args.cache_dir)
                     if accelerator.is_main_process else [])  # the accuracy report is the main process's
        trainable = HeadsOnHiddenStates(model, args.soft_target_weight, args.soft_target_temperature)
        collate = collate_cached

    sampler = EpochBatches(len(dataset), args.batch_size, args.seed)
    # Not through `accelerator.prepare`: every process iterates the same global batches and collates its share.
    loader = DataLoader(dataset, batch_sampler=sampler,
                        collate_fn=process_share(collate, accelerator.process_index, accelerator.num_processes))
    per_epoch = len(loader)
    total_steps = args.max_steps or int(per_epoch * args.epochs / args.grad_accum)
    params = [p for p in trainable.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(args.warmup_steps, 1))
                                                  * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    trainable, optimizer, scheduler = accelerator.prepare(trainable, optimizer, scheduler)

    step, state_dir = 0, out / "state"
    checkpoint = latest_checkpoint(state_dir) if args.resume else None
    if checkpoint:
        accelerator.load_state(str(checkpoint[0]))
        step = checkpoint[1]
        if accelerator.is_main_process:
            keep_log_until(out / "train_log.jsonl", step)  # the steps after the checkpoint are run again
        log(f"resumed from step {step}")
    else:
        if args.resume:
            log(f"--resume: no checkpoint in {state_dir}, starting from step 0")
        if accelerator.is_main_process:
            (out / "train_log.jsonl").unlink(missing_ok=True)  # a fresh run starts a fresh log
    def batches():
        """Every batch from step `step` on, epoch after epoch (each epoch re-shuffled deterministically)."""
        done = step * args.grad_accum
        epoch = done // per_epoch
        while True:
            sampler.use_epoch(epoch, skip=done - epoch * per_epoch)
            yield from loader
            epoch += 1
            done = epoch * per_epoch

    trainable.train()
    history = []
    for batch in batches():
        if step >= total_steps:
            break
        scored = batch.pop("scored")
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        with accelerator.accumulate(trainable):
            if lora:
                result = trainable(**batch, base_loss_weight=args.base_loss_weight, return_head_logits=False)
                loss, head_losses = result.loss, result.head_losses
                if args.kl_weight > 0:
                    with torch.no_grad(), accelerator.unwrap_model(trainable).disable_adapter():
                        frozen = trainable(**batch, return_head_logits=False).logits
                    mask = batch["labels"] != -100
                    kl = torch.nn.functional.kl_div(result.logits[mask].float().log_softmax(-1),
                                                    frozen[mask].float().log_softmax(-1), log_target=True,
                                                    reduction="batchmean")
                    loss = loss + args.kl_weight * kl
                if parallel:  # the whole loss weighted by the share of the step's tokens
                    share = share_of_positions(accelerator, [int((batch["labels"][:, 1:] != -100).sum())], scored,
                                               loss.device)
                    loss, head_losses = loss * share[0], head_losses * share[0]
            elif parallel:  # each head's mean weighted by the share of the step's positions it scored
                _, head_losses, stats = trainable(batch["hidden"], batch["labels"], return_stats=True)
                head_losses = head_losses * share_of_positions(accelerator, [n for n, _, _ in stats], scored,
                                                               head_losses.device)
                weights = model.config.head_loss_weights[: len(head_losses)]
                loss = (torch.tensor(weights, dtype=head_losses.dtype, device=head_losses.device) * head_losses).sum()
            else:
                loss, head_losses = trainable(batch["hidden"], batch["labels"])
            # the gradients are averaged over the processes: the sum of the shares' gradients is the global batch's
            accelerator.backward(loss * accelerator.num_processes if parallel else loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        if parallel:  # the global batch's loss: the sum of the processes' shares
            summed = accelerator.reduce(torch.cat([loss.detach().reshape(1), head_losses.detach()]), "sum")
            loss, head_losses = summed[0], summed[1:]
        entry = {"step": step, "loss": float(loss.detach()),
                 "head_losses": [round(float(x), 5) for x in head_losses.detach()],
                 "lr": scheduler.get_last_lr()[0]}
        history.append(entry)
        if accelerator.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            with (out / "train_log.jsonl").open("a") as f:
                f.write(json.dumps(entry) + "\n")
        if step % args.log_steps == 0 or step == 1:
            log(f"step {step}/{total_steps} loss {entry['loss']:.4f} heads {entry['head_losses']}")
        if step % args.save_steps == 0:
            save_checkpoint(accelerator, state_dir, step)

    accelerator.wait_for_everyone()
    minutes = (time.perf_counter() - started) / 60
    if lora:
        unwrapped = accelerator.unwrap_model(trainable)
        adapter_dir = out / "base_adapter"
        if accelerator.is_main_process:
            save_base_adapter(unwrapped, adapter_dir)
        model = unwrapped.merge_and_unload()
        accuracy = []
    else:
        accuracy = head_accuracy(accelerator.unwrap_model(trainable), eval_data) if accelerator.is_main_process else []
    for row in accuracy:
        log(f"head {row['head']}: top-1 {row['top1']:.3f}  top-5 {row['top5']:.3f}  ({row['positions']} positions)")
    if accelerator.is_main_process:
        training = {"data": [os.path.basename(d) for d in args.data], "examples": len(train_examples),
                    "tokens": sum(len(e["input_ids"]) for e in train_examples), "steps": step,
                    "lr": args.lr, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                    "processes": accelerator.num_processes, "dtype": args.dtype,
                    "epochs": args.epochs, "targets": args.targets, "head_type": model.config.head_type,
                    "soft_target_weight": args.soft_target_weight,
                    "soft_target_temperature": args.soft_target_temperature, "mode": "lora-base" if lora else "frozen base (cached hidden states)",
                    "minutes": round(minutes, 1), "eval_head_accuracy": accuracy}
        out.mkdir(parents=True, exist_ok=True)
        (out / "training.json").write_text(json.dumps(training, indent=2))
        if lora:
            model.config.base_adapter = "base_adapter"
        model.save_pretrained(out)  # config, heads and a model card that reports training.json
        if args.push_to_hub:
            model.push_to_hub(args.push_to_hub)
        log(f"saved to {out} after {minutes:.1f} min")


if __name__ == "__main__":
    main()
