"""Pick and tune the rescorers a checkpoint bundles: α per rescorer on held-out prompts, best n-gram by block efficiency. (`hf_bpd.training.tune_rescorers`; run with `python` or `accelerate launch`, `--help` for options)."""

import sys

from hf_bpd.training.tune_rescorers import main

if __name__ == "__main__":
    sys.exit(main())
