"""`python -m hf_bpd.cli`: the `hf-bpd` command."""

import sys

from . import main

sys.exit(main())
