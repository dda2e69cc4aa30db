"""Interpolation weight α: tuned per task on held-out prompts by maximising block efficiency (paper App. E).

Greedy decoding is deterministic, so the block efficiency of a rescorer with a given α can be computed without
decoding again: the base's greedy continuation of each prompt is generated once, one forward pass over it gives every
step's hidden state, and the accepted length of each step's (rescored) draft is read off against the continuation
(`hf_bpd.evaluation.analysis`). Each α then costs only the rescoring.
"""

from __future__ import annotations

from .analysis import analyze_prompt, simulated_block_efficiency

ALPHA_GRID = (0.1, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0, 5.0, 10.0)


def tune_alpha(model, rescorer, prompts, max_new_tokens: int = 128, grid=ALPHA_GRID, top_k: int = 16,
               references=None) -> dict:
    """Block efficiency of `rescorer` for every α in `grid` on `prompts` (list of `(1, seq)` input ids).

    Returns `{"alpha": best α, "block_efficiency": {α: BE}, "vanilla": BE without rescoring, "references": [...]}`;
    `references` (the base's greedy continuations) can be passed back in to tune another rescorer on the same
    prompts without generating again. BE is pooled over prompts: total tokens / total serial calls.
    """
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
