"""Tokenise training sources once into a token stream for `train_drafter.py --online --tokens`
(`hf_bpd.training.token_stream`; `--help` for options)."""

import sys

from hf_bpd.training.token_stream import main

if __name__ == "__main__":
    sys.exit(main())
