"""Base features for feature-level drafters: hidden states and top-k next-token log-probabilities over text, in
resumable shards (`hf_bpd.training.features`; `--help` for options)."""

import sys

from hf_bpd.training.features import main

if __name__ == "__main__":
    sys.exit(main())
