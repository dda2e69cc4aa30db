"""`hf-bpd calibrate`: how often a head's drafted token is accepted, as a function of the head's confidence.

Chain decoding (one draft per step, every drafted token verified) on held-out prompts records, per step, the heads'
probabilities of the drafted tokens and how many were accepted. Draft token `i` was *tried* when tokens `0..i-1`
were accepted and *accepted* when `i` < the accepted length. `HeadCalibration.fit` bins the tries per head;
`draft_schedule="cost"` reads the fitted rates from the checkpoint's `config.json` (`head_calibration`). Prompt
lookup's copy is scored the same way, per position, from what followed each step (`lookup_records`); chain drafting
with `prompt_lookup=True` weighs the two with these rates. With a node budget (`draft_nodes`) the p-best paths compete
too: a token first drafted by a lower-ranked path is accepted less often than its head's confidence says, and the
factor per rank is measured teacher-forced along the same greedy outputs (`rank_records`).
"""

from __future__ import annotations

import torch

from ..generation.calibration import HeadCalibration
from ..generation.lookup import prompt_lookup
from ..lattice import Lattice
from .analysis import teacher_forced_heads


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


@torch.no_grad()
def rank_records(model, sequence: list[int], prompt_length: int, rescorer, num_heads: int, top_k: int,
                 num_drafts: int) -> list[tuple[int, int, float, bool]]:
    """`(rank, head, probability, accepted)` for every token of the `num_drafts` best paths at every position of one
    greedy output that would be tried (its path's earlier tokens are the output's), `rank` being the best path that
    drafts it. Teacher-forced: one base forward over the output, the heads on every position."""
    new = sequence[prompt_length:]
    steps = len(new) - 1
    if steps <= 0:
        return []
    _, chunks = teacher_forced_heads(model, torch.tensor([sequence], device=model.device), prompt_length, num_heads)
    records = []
    rescorer.reset()
    for start, logits in chunks:  # (heads, chunk, draft vocab)
        for offset in range(logits.shape[1]):
            j = start + offset
            lattice = Lattice.from_head_logits(logits[:, offset], top_k, model.heads.to_vocab_ids)
            truth = new[j + 1: j + 1 + num_heads]
            seen = set()
            for rank, draft in enumerate(rescorer.rescore(lattice, sequence[: prompt_length + j + 1], num_drafts)):
                probs = lattice.token_probs(draft.tokens)
                for i, token in enumerate(draft.tokens[: len(truth)]):
                    if tuple(draft.tokens[:i]) != tuple(truth[:i]):
                        break  # not tried: an earlier token is rejected
                    if draft.tokens[: i + 1] not in seen:
                        seen.add(draft.tokens[: i + 1])
                        records.append((rank, i, probs[i], token == truth[i]))
    return records


def calibrate(model, prompts, max_new_tokens: int = 256, bins: int = 10, rank_paths: int = 8, **options) -> tuple[HeadCalibration, list]:
    """Fit a `HeadCalibration` for `model` from chain decoding of `prompts` (a list of encoded inputs): the heads'
    rates per confidence bin, prompt lookup's per-position rates and the p-best paths' rank factors (`rank_paths`
    best paths of the rescorer's top-k lattice). `options` are drafting options (e.g. `rescorer`), the checkpoint's
    own by default. Returns `(calibration, head records)`."""
    from ..generation.config import drafting_options
    from ..generation.decoding import plan_drafting

    records, copies, ranked = [], [], []
    # the p-best drafter `generate(num_drafts=rank_paths)` would use (rescorer, lattice width), over every head
    ranking = {k: v for k, v in options.items() if k in ("rescorer", "draft_top_k")}
    ranking.update(num_drafts=max(rank_paths, 1), num_heads_to_use=options.get("num_heads_to_use") or
                   model.config.num_heads, tree=None, draft_nodes=None, prompt_lookup=False, draft_schedule="fixed")
    drafter = plan_drafting(model, drafting_options(ranking, None, model.generation_config)).drafter
    options.setdefault("compile", False)  # acceptance does not depend on the kernels; compiling would cost minutes
    for inputs in prompts:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_drafts=1, tree=None,
                             draft_nodes=None, draft_schedule="fixed", prompt_lookup=False, **options)
        stats = model.last_generation_stats
        records += acceptance_records(stats)
        copies += lookup_records(out[0].tolist(), inputs["input_ids"].shape[1], stats, model.config.num_heads)
        if rank_paths > 1:
            ranked += rank_records(model, out[0].tolist(), inputs["input_ids"].shape[1], drafter.rescorer,
                                   drafter.num_heads, drafter.top_k, rank_paths)
    calibration = HeadCalibration.fit(records, model.config.num_heads, bins=bins, lookup_records=copies,
                                      rank_records=ranked)
    return calibration, records


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
