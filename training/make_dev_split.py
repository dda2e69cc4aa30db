"""Hold out a dev split and a tuning split of instruction prompts (MT-bench layout: question_id, category, turns). (`hf_bpd.training.make_dev_split`; run with `python` or `accelerate launch`, `--help` for options)."""

import sys

from hf_bpd.training.make_dev_split import main

if __name__ == "__main__":
    sys.exit(main())
