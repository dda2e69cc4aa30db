"""Compilation without noise: inductor's `max_autotune` writes a table per GEMM it tunes (`AUTOTUNE packed_linear(...)`,
`SingleProcess AUTOTUNE benchmarking takes ...`, `Autotune Choices Stats: {...}`) straight to stderr, many lines
for every step compiled, and its benchmarking raises deprecation warnings. `quiet_compilation()` turns both off around
hf_bpd's own compiles (the user's own `torch.compile` calls are untouched), unless `HF_BPD_DEBUG=1` or transformers'
logging verbosity is INFO or more detailed (`transformers.logging.set_verbosity_info()`)."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings


def verbose() -> bool:
    """Whether compiler output is wanted: `HF_BPD_DEBUG=1`, or transformers' verbosity at INFO or below."""
    if os.environ.get("HF_BPD_DEBUG", "") not in ("", "0"):
        return True
    from transformers.utils import logging as hf_logging

    return hf_logging.get_verbosity() <= logging.INFO


@contextlib.contextmanager
def quiet_compilation():
    if verbose():
        yield
        return
    import torch._inductor.config as inductor_config
    from torch._inductor import select_algorithm

    printed = getattr(select_algorithm, "PRINT_AUTOTUNE", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(max_autotune_report_choices_stats=False))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", UserWarning)
        if printed is not None:  # the tables' switch: a module flag of inductor, restored below
            select_algorithm.PRINT_AUTOTUNE = False
            stack.callback(setattr, select_algorithm, "PRINT_AUTOTUNE", printed)
        yield
