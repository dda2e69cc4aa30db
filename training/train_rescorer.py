"""Train the small neural rescorer (paper Sec. 7.1): the base's first layers plus a LoRA, sharing its vocabulary. (`hf_bpd.training.train_rescorer`; run with `python` or `accelerate launch`, `--help` for options)."""

import sys

from hf_bpd.training.train_rescorer import main

if __name__ == "__main__":
    sys.exit(main())
