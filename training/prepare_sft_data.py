"""Mix instruction data into one ShareGPT JSONL for head training, holding out the dev prompts. (`hf_bpd.training.prepare_sft_data`; run with `python` or `accelerate launch`, `--help` for options)."""

import sys

from hf_bpd.training.prepare_sft_data import main

if __name__ == "__main__":
    sys.exit(main())
