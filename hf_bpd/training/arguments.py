"""The options of `train_heads` (`accelerate launch training/train_heads.py`, `hf-bpd train`), in a module that
imports nothing heavy: `hf-bpd train --help` and option errors come before torch, accelerate and datasets load."""

import argparse

DESCRIPTION = """Train BPD drafting heads with Accelerate (and optionally LoRA in the base through peft).

    accelerate launch training/train_heads.py --model smollm2-135m-instruct --data data/distilled.jsonl \\
        --num-heads 4 --draft-vocab-size 16384 --epochs 2 --output-dir checkpoints/my-heads
    python training/train_heads.py ...            # the same on one CPU process
    accelerate launch --config_file configs/cpu.yaml training/train_heads.py ... --threads 1
                                                  # data-parallel (configs/: CPU, one GPU, several GPUs)

Frozen base (default, Medusa-1 / the paper's setting): base hidden states are cached once and only the heads train.
`--lora-base q_proj,v_proj`: Medusa-2 style, LoRA in the base trained jointly with the heads; the base's own
next-token loss (`--base-loss-weight`) or a KL to the frozen base (`--kl-weight`, via peft's adapter disabling) keeps
its outputs from drifting. `--resume` continues from the last `accelerator.save_state` checkpoint without losing a
step. Data: ShareGPT/Vicuna JSON(L) (`conversations`) or Alpaca records, rendered with the chat template, loss on
assistant tokens only. Several processes give the run one process would give (same batches, same loss curve):
`--batch-size` is the global batch, each process takes its share of it.
"""


def build_parser(prog=None, parser_class=argparse.ArgumentParser, formatter_class=None) -> argparse.ArgumentParser:
    """train_heads' argument parser (`parser_class` / `formatter_class`: the CLI's one-line errors and defaults)."""
    p = parser_class(prog=prog, description=DESCRIPTION,
                     formatter_class=formatter_class or argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="base model (alias, directory, Hub id)")
    p.add_argument("--init-from", help="continue training the heads of this BPD checkpoint")
    p.add_argument("--data", nargs="+", required=True, help="ShareGPT/Alpaca JSON or JSONL files")
    p.add_argument("--targets", default="data", choices=["data", "base"],
                   help="train on the data's tokens, or on the base's own greedy predictions along the data "
                        "(teacher-forced self-distillation; frozen-base mode)")
    p.add_argument("--eval-fraction", type=float, default=0.02,
                   help="share of the examples held out for the per-head accuracy report")
    p.add_argument("--max-examples", type=int, default=None, help="use only the first N examples")
    p.add_argument("--max-length", type=int, default=768, help="tokens per example (longer ones are cut)")
    p.add_argument("--num-heads", type=int, default=4, help="drafting heads (block size = heads + 1)")
    p.add_argument("--head-type", default="resblock", choices=["resblock", "ffn", "hydra"],
                   help="resblock (Medusa), ffn (Stern et al.), hydra (sequentially dependent ffn heads: each also "
                        "reads the previous head's state and the embedding of the token before its own)")
    p.add_argument("--num-layers-per-head", type=int, default=1, help="blocks stacked in each head")
    p.add_argument("--head-intermediate-size", type=int, default=None,
                   help="hidden width of an ffn head (default: the base's hidden size)")
    p.add_argument("--own-projection", action="store_true", help="heads own their output projection")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="score only the N most frequent tokens")
    p.add_argument("--head-loss-weights", default=None, help="comma-separated λ_h, e.g. 1,0.8,0.6,0.4")
    p.add_argument("--soft-target-weight", type=float, default=0.0,
                   help="w in (1 - w) CE + w T^2 KL: train each head also on the base's full next-token distribution "
                        "at its position (soft targets, from the cached hidden states; frozen-base mode), 0..1")
    p.add_argument("--soft-target-temperature", type=float, default=1.0, help="T of the soft targets (> 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (cosine schedule)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the training examples")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps")
    p.add_argument("--batch-size", type=int, default=8,
                   help="examples per step (per micro-step with --grad-accum), over all processes: each of N "
                        "processes takes every N-th example of it")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--save-steps", type=int, default=200,
                   help="save a resumable accelerate state every N steps")
    p.add_argument("--log-steps", type=int, default=10, help="print the loss every N steps")
    p.add_argument("--output-dir", required=True, help="where the trained checkpoint is saved")
    p.add_argument("--cache-dir", default=None,
                   help="keep the base hidden states here (safetensors shards, per example) and reuse them in later "
                        "runs on the same base and targets: only examples not seen before run the base (frozen-base "
                        "mode). With several processes they share the base forwards through it (a directory all of them "
                        "see); without it each runs the base over every example")
    p.add_argument("--resume", action="store_true", help="continue from output-dir/state")
    p.add_argument("--lora-base", default=None, help="comma-separated base modules for LoRA (Medusa-2 mode)")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (with --lora-base)")
    p.add_argument("--base-loss-weight", type=float, default=1.0, help="LoRA mode: weight of the base's own loss")
    p.add_argument("--kl-weight", type=float, default=0.0, help="LoRA mode: KL(frozen base || adapted base)")
    p.add_argument("--push-to-hub", default=None, help="repo id to upload the checkpoint to")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the shuffling and the heads")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the base's dtype (its forwards: caching hidden states, every step with --lora-base); the "
                        "heads share its output layer and follow it. For bf16 compute over fp32 weights use "
                        "accelerate's --mixed_precision bf16 instead")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: accelerate's choice (its config, or a GPU when there is one); cpu: train on CPU even "
                        "where there is a GPU; cuda: refuse to start without one")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per process (default: torch's, which follows OMP_NUM_THREADS)")
    return p


def parse_args(argv=None, prog=None):
    return build_parser(prog).parse_args(argv)
