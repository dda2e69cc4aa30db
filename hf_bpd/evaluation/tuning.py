"""Interpolation weight α: tuned per task on held-out prompts by maximising block efficiency (paper App. E).

Greedy decoding is deterministic, so the block efficiency of a rescorer with a given α can be computed without
decoding again: the base's greedy continuation of each prompt is generated once, one forward pass over it gives every
step's hidden state, and the accepted length of each step's (rescored) draft is read off against the continuation
(`hf_bpd.evaluation.analysis`). Each α then costs only the rescoring.
"""

from __future__ import annotations

import math

from ..errors import BPDConfigError, BPDTypeError
from ..limits import MAX_DRAFT_TOP_K
from .analysis import analyze_prompt, simulated_block_efficiency

ALPHA_GRID = (0.1, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0, 5.0, 10.0)


def tune_alpha(model, rescorer, prompts, max_new_tokens: int = 128, grid=ALPHA_GRID, top_k: int = 16,
               references=None) -> dict:
    """Block efficiency of `rescorer` for every α in `grid` on `prompts` (list of `(1, seq)` input ids).

    Returns `{"alpha": best α, "block_efficiency": {α: BE}, "vanilla": BE without rescoring, "references": [...]}`;
    `references` (the base's greedy continuations) can be passed back in to tune another rescorer on the same
    prompts without generating again. BE is pooled over prompts: total tokens / total serial calls.
    """
    grid = check_tuning_inputs(model, rescorer, prompts, max_new_tokens, grid, top_k)
    if references is None:
        references = [model.base_lm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False) for ids in prompts]
    results, vanilla = {}, None
    for alpha in grid:
        rescorer.alpha = float(alpha)
        tokens = calls = 0
        vanilla_tokens = vanilla_calls = 0
        for ids, reference in zip(prompts, references):
            record = analyze_prompt(model, ids, max_new_tokens, top_ks=(1,), rescorer=rescorer, rescore_top_k=top_k,
                                    reference=reference)
            n = len(record.new_tokens)
            if n == 0:
                continue
            be = simulated_block_efficiency(record.rescored_accepted, n)
            tokens, calls = tokens + n, calls + n / be
            if vanilla is None:
                vbe = simulated_block_efficiency(record.vanilla_accepted, n)
                vanilla_tokens, vanilla_calls = vanilla_tokens + n, vanilla_calls + n / vbe
        results[float(alpha)] = tokens / calls if calls else 0.0
        if vanilla is None:
            vanilla = vanilla_tokens / vanilla_calls if vanilla_calls else 0.0
    best = max(results, key=results.get)
    rescorer.alpha = best
    return {"alpha": best, "block_efficiency": results, "vanilla": vanilla, "references": references}


def check_tuning_inputs(model, rescorer, prompts, max_new_tokens, grid, top_k) -> list[float]:
    """One-line errors for `tune_alpha`'s arguments, before anything is generated; returns the grid as floats."""
    from ..rescorers.base import Rescorer

    if not hasattr(model, "heads"):
        raise BPDConfigError("tune_alpha needs a BlockwiseParallelForCausalLM (heads checkpoint), got a plain model")
    if not isinstance(rescorer, Rescorer) or not hasattr(rescorer, "alpha"):
        raise BPDTypeError(f"rescorer must be a hf_bpd.Rescorer with an alpha (NgramRescorer, NeuralRescorer), got "
                           f"{type(rescorer).__name__}")
    if not prompts:
        raise BPDConfigError("no prompts to tune on: pass at least one (1, length) tensor of input ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BPDConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    width = min(MAX_DRAFT_TOP_K, model.config.draft_size)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= width:
        raise BPDConfigError(f"top_k (the lattice width) must be an integer in [1, {width}], got {top_k!r}")
    rescorer.check_compatible(model)
    rescorer.check_work(model.config.num_heads, top_k, 1)
    values = list(grid) if isinstance(grid, (list, tuple)) else None
    if not values or any(isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0
                         for a in values):
        raise BPDConfigError(f"grid must be a non-empty list of finite numbers >= 0 (alpha values), got {grid!r}: "
                             "e.g. 0.1,0.5,1,2")
    return [float(a) for a in values]
