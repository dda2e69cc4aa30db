"""Train BPD drafting heads with Accelerate (and optionally LoRA in the base through peft). (`hf_bpd.training.train_heads`; run with `python` or `accelerate launch`, `--help` for options)."""

import sys

from hf_bpd.training.train_heads import main

if __name__ == "__main__":
    sys.exit(main())
