"""Self-distillation: the base model's own answers to a prompt set, written as ShareGPT JSONL. (`hf_bpd.training.self_distill`; run with `python` or `accelerate launch`, `--help` for options)."""

import sys

from hf_bpd.training.self_distill import main

if __name__ == "__main__":
    sys.exit(main())
