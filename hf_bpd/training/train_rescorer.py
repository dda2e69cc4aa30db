"""Train the small neural rescorer (paper Sec. 7.1): the base's first layers plus a LoRA, sharing its vocabulary.

    accelerate launch training/train_rescorer.py --model smollm2-135m-instruct --data data/sft_mix.jsonl \\
        --num-layers 2 --max-steps 300 --output-dir checkpoints/my-heads/rescorers/neural

A rescorer must be cheap next to a base step: it reuses the base's embeddings, first `--num-layers` decoder layers,
final norm and output layer (so nothing new is stored but a LoRA adapter), and learns to predict the next token from
those early layers. Bundle it with `model.bundle_rescorer("neural", dir, type="base_prefix", num_layers=N)`.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

import hf_bpd
from ..rescorers.neural import truncated_base
from .hidden_states import build_examples
from .train_heads import EpochBatches, collate_tokens, load_records


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--max-examples", type=int, default=None)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def train_step(lm, batch, optimizer, accelerator) -> float:
    loss = lm(**batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    accelerator = Accelerator()
    set_seed(args.seed)
    started = time.perf_counter()
    base, tokenizer = hf_bpd.load_base(args.model)
    examples, skipped = build_examples(tokenizer, load_records(args.data), args.max_length)
    examples = examples[: args.max_examples]
    lm = get_peft_model(truncated_base(base, args.num_layers),
                        LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear"))
    del base
    sampler = EpochBatches(len(examples), args.batch_size, args.seed)
    loader = DataLoader(examples, batch_sampler=sampler, collate_fn=collate_tokens(tokenizer.pad_token_id or 0))
    optimizer = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=args.lr)
    lm, optimizer, loader = accelerator.prepare(lm, optimizer, loader)
    lm.train()
    first = last = None
    step = 0
    for epoch in range(math.ceil(args.max_steps / max(len(loader), 1))):
        sampler.use_epoch(epoch)
        for batch in loader:
            step += 1
            if step > args.max_steps:
                break
            loss = train_step(lm, batch, optimizer, accelerator)
            first = loss if first is None else first
            last = loss
            if step % 20 == 0 or step == 1:
                accelerator.print(f"step {step}/{args.max_steps} loss {last:.4f}", flush=True)
    if accelerator.is_main_process:
        out = Path(args.output_dir)
        accelerator.unwrap_model(lm).save_pretrained(out)
        info = {"num_layers": args.num_layers, "lora_r": args.lora_r, "steps": min(step, args.max_steps),
                "examples": len(examples), "first_loss": first, "last_loss": last,
                "minutes": round((time.perf_counter() - started) / 60, 1)}
        (out / "rescorer_training.json").write_text(json.dumps(info, indent=2))
        accelerator.print(f"saved the rescorer adapter to {out}: {info}")


if __name__ == "__main__":
    main()
