"""The documented ceilings (docs/reliability.md "Ceilings"): every value hf_bpd accepts keeps one decoding step bounded in
time and memory; a value beyond a ceiling is refused up front with a one-line error. This module imports nothing, so
the command line checks its flags against the same numbers before loading anything.

How they were chosen (SmolLM2-135M checkpoint, its 4-gram, 2 CPU cores; docs/reliability.md "Ceilings"):

* `MAX_DRAFT_TOP_K`, `MAX_NUM_DRAFTS`: bound the rescorer's input and the verification block; the defaults are k = 16
  when rescoring, p = 1.
* `MAX_DRAFT_NODES`: draft tokens verified in one forward pass (num_drafts x heads, or tree nodes; = the tree
  verifier's `MAX_TREE_NODES`): each step's verification forward grows with it.
* `MAX_RESCORING_WORK`: rescoring cost estimate, draft_top_k x num_drafts x heads. 64 x 64 x 4 = 16,384 is implied by
  the three ceilings above; the compiled n-gram search took at most 0.04 s per step at 4 heads (0.25 s at 32
  heads x k=64 x p=8) with the 64 most frequent tokens in every row (the hardest lattice tried), under 50 MB.
* `PYTHON_NGRAM_MAX_WORK`, `PYTHON_NGRAM_MAX_TOP_K`: the pure-Python n-gram search (the fallback when the compiled one
  is not built) keeps every KenLM state in Python objects: 4 heads x k=64 x p=64 took 11 s and 2.2 GB per step, 5 heads
  36 s and 5 GB (the issue's draft_top_k=1024 took 49 s and 5 GB, 4096 was killed at 24 GB). Within these ceilings
  the slowest step measured 1.7 s (32 heads x k=32), 4 heads at most 0.4 s.
"""

MAX_DRAFT_TOP_K = 64  # lattice width k
MAX_NUM_DRAFTS = 64  # p: drafts verified together
MAX_DRAFT_NODES = 256  # draft tokens per verification pass (num_drafts x heads; tree nodes) = tree.MAX_TREE_NODES
MAX_RESCORING_WORK = MAX_DRAFT_TOP_K * MAX_NUM_DRAFTS * 4  # draft_top_k x num_drafts x heads, any rescorer
PYTHON_NGRAM_MAX_WORK = 1024  # the same estimate, for the pure-Python n-gram search
PYTHON_NGRAM_MAX_TOP_K = 32  # its lattice width (its cost grows with k^3 at 4 heads)
MAX_COST_SCHEDULE_BLOCK = 32  # draft_schedule="cost": tokens per verification it weighs (the forward cost of every
# block length up to the largest is measured once per process when no `hf-bpd profile` table covers it)
HUB_PROBE_TIMEOUT = 1.5  # seconds: a Hub that does not accept a connection by then counts as unreachable
