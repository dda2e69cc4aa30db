"""Train a feature-level (EAGLE-style) drafter on extracted base features (`hf_bpd.training.train_drafter`;
`--help` for options)."""

import sys

from hf_bpd.training.train_drafter import main

if __name__ == "__main__":
    sys.exit(main())
