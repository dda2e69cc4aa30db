"""`hf-bpd calibrate`: how often a head's drafted token is accepted, as a function of the head's confidence.

Chain decoding (one draft per step, every drafted token verified) on held-out prompts records, per step, the heads'
probabilities of the drafted tokens and how many were accepted. Draft token `i` was *tried* when tokens `0..i-1`
were accepted and *accepted* when `i` < the accepted length. `HeadCalibration.fit` bins the tries per head;
`draft_schedule="cost"` reads the fitted rates from the checkpoint's `config.json` (`head_calibration`).
"""

from __future__ import annotations

from ..generation.budget import HeadCalibration


def acceptance_records(stats) -> list[tuple[int, float, bool]]:
    """`(head, probability, accepted)` for every tried draft token of one chain-decoding call's `GenerationStats`."""
    records = []
    for probs, accepted, verified in zip(stats.draft_probs, stats.accepted_lengths[1:], stats.draft_tokens[1:]):
        for i, prob in enumerate(probs[:verified]):
            if i > accepted:
                break
            records.append((i, float(prob), i < accepted))
    return records


def calibrate(model, prompts, max_new_tokens: int = 256, bins: int = 10, **options) -> tuple[HeadCalibration, list]:
    """Fit a `HeadCalibration` for `model` from chain decoding of `prompts` (a list of encoded inputs); `options`
    are drafting options (e.g. `rescorer`), the checkpoint's own by default. Returns `(calibration, records)`."""
    records = []
    for inputs in prompts:
        model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_drafts=1, tree=None,
                       draft_schedule="fixed", **options)
        records += acceptance_records(model.last_generation_stats)
    return HeadCalibration.fit(records, model.config.num_heads, bins=bins), records


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
