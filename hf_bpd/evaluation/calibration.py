"""`hf-bpd calibrate`: how often a head's drafted token is accepted, as a function of the head's confidence.

Chain decoding (one draft per step, every drafted token verified) on held-out prompts records, per step, the heads'
probabilities of the drafted tokens and how many were accepted. Draft token `i` was *tried* when tokens `0..i-1`
were accepted and *accepted* when `i` < the accepted length. `HeadCalibration.fit` bins the tries per head;
`draft_schedule="cost"` reads the fitted rates from the checkpoint's `config.json` (`head_calibration`). Prompt
lookup's copy is scored the same way, per position, from what followed each step (`lookup_records`); chain drafting
with `prompt_lookup=True` weighs the two with these rates.
"""

from __future__ import annotations

from ..generation.budget import HeadCalibration
from ..generation.lookup import prompt_lookup


def acceptance_records(stats) -> list[tuple[int, float, bool]]:
    """`(head, probability, accepted)` for every tried draft token of one chain-decoding call's `GenerationStats`."""
    records = []
    for probs, accepted, verified in zip(stats.draft_probs, stats.accepted_lengths[1:], stats.draft_tokens[1:]):
        for i, prob in enumerate(probs[:verified]):
            if i > accepted:
                break
            records.append((i, float(prob), i < accepted))
    return records


def lookup_records(sequence: list[int], prompt_length: int, stats, num_tokens: int) -> list[tuple[int, bool]]:
    """`(position, accepted)` for prompt lookup's copy at every step of one greedy call, had it been verified.

    The output is the base's greedy sequence, so a draft's accepted length is its common prefix with the tokens
    that followed the step's context (the same reading `hf-bpd analyze` uses)."""
    records, decoded = [], 1  # the prompt pass decoded one token
    for accepted in stats.accepted_lengths[1:]:
        start = prompt_length + decoded
        copied = prompt_lookup(sequence[:start], num_tokens)
        truth = sequence[start: start + len(copied)]
        for j, token in enumerate(copied[: len(truth)]):
            records.append((j, token == truth[j]))
            if token != truth[j]:
                break
        decoded += accepted + 1
    return records


def calibrate(model, prompts, max_new_tokens: int = 256, bins: int = 10, **options) -> tuple[HeadCalibration, list]:
    """Fit a `HeadCalibration` for `model` from chain decoding of `prompts` (a list of encoded inputs): the heads'
    rates per confidence bin and prompt lookup's per-position rates. `options` are drafting options (e.g.
    `rescorer`), the checkpoint's own by default. Returns `(calibration, head records)`."""
    records, copies = [], []
    options.setdefault("compile", False)  # acceptance does not depend on the kernels; compiling would cost minutes
    for inputs in prompts:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_drafts=1, tree=None,
                             draft_schedule="fixed", prompt_lookup=False, **options)
        stats = model.last_generation_stats
        records += acceptance_records(stats)
        copies += lookup_records(out[0].tolist(), inputs["input_ids"].shape[1], stats, model.config.num_heads)
    return HeadCalibration.fit(records, model.config.num_heads, bins=bins, lookup_records=copies), records


def reliability_table(calibration: HeadCalibration, records) -> str:
    """Markdown: per head and bin, tries, mean head probability, measured acceptance rate, fitted rate."""
    lines = ["| head | bin (prob ≤) | tries | mean prob | accepted | fitted |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for head, row in enumerate(calibration.accept):
        for b, edge in enumerate(calibration.edges):
            inside = [(p, ok) for h, p, ok in records if h == head and calibration.bin(p) == b]
            if inside:
                mean = sum(p for p, _ in inside) / len(inside)
                rate = sum(ok for _, ok in inside) / len(inside)
                lines.append(f"| {head + 1} | {edge:.1f} | {len(inside)} | {mean:.2f} | {rate:.2f} | {row[b]:.2f} |")
    return "\n".join(lines) + "\n"
