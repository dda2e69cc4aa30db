"""Timing-free draft quality of a feature-level drafter (`hf_bpd.feature_drafter`) along the base's greedy
continuations: the block efficiency its chain drafts would reach in greedy decoding.

Greedy decoding is exact, so along the base's own greedy continuation of a prompt every step's outcome is known: a
step whose last token is at index L-1 drafts from the base's feature at L-2 (what produced that token), its drafts
are accepted while they equal the continuation, and the base adds one token of its own. The features come from one
base forward over prompt + continuation; the drafter's context (its KV cache over every earlier position, from the
base's features) from one teacher-forced drafter pass, cut at each step's position, from which the drafter drafts
`depth` tokens autoregressively, each reading the feature it predicted. `block_efficiency = new tokens / serial
calls` (the prompt pass counts as a call that decodes one token), as in `hf_bpd.evaluation.analysis`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .analysis import accepted_length, simulated_steps


@torch.no_grad()
def base_features(base, ids: torch.Tensor, layers=None) -> torch.Tensor | dict[str, torch.Tensor]:
    """`(n, hidden)`: the base's final (normed) hidden state at every position of `ids (n,)`; with `layers` (-1: the
    final one, i: the output of decoder layer i) a mapping `hidden_<i>` of them, for drafters that fuse layers."""
    out = base(input_ids=ids[None].to(base.device), output_hidden_states=True, use_cache=False)
    if layers is None:
        return out.hidden_states[-1][0]
    return {f"hidden_{i}": out.hidden_states[-1 if i == -1 else i + 1][0] for i in layers}


def _drafter_context(drafter, features, ids: torch.Tensor):
    """One teacher-forced drafter pass along `ids`: `(its hidden states (1, n-1, hidden), its keys and values at
    every position, the positions (1, n))`, the context each step cuts at its own position."""
    n = len(ids)
    if isinstance(features, dict):  # the base's hidden states by layer: what this drafter reads of them
        features = drafter.read_features(features)
    feats = features.to(drafter.fuse.weight.dtype)[None]
    positions = torch.arange(n, device=feats.device)[None]
    context = DynamicCache(config=drafter.config)
    hidden = drafter(feats[:, :n - 1], ids[None, 1:], positions[:, :n - 1], context)
    layer = context.layers[0]
    return hidden, layer.keys, layer.values, positions


def _tree_accepted(drafter, along, ids: torch.Tensor, last: int, depth: int, top_ks) -> dict[int, int]:
    """`{k: draft tokens accepted}` of a full top-k tree of the drafter at the step that guesses `ids[last]` first
    (`along`: `_drafter_context`): a token counts when it is among the drafter's k most likely at its depth (the
    drafter's argmax for k = 1), and the drafter reads the reference's token for the next depth."""
    hidden, keys, values, positions = along
    p, room = last - 2, min(depth, len(ids) - last)  # the position whose feature produced the last token
    cache = DynamicCache(config=drafter.config)
    cache.update(keys[:, :, :p + 1], values[:, :, :p + 1], 0)
    state, counts, alive, widest = hidden[:, p:p + 1], dict.fromkeys(top_ks, 0), set(top_ks), max(top_ks)
    for d in range(room):
        logits = drafter.logits(state)[0, -1]
        want = int(ids[last + d])
        best = int(drafter.to_vocab_ids(logits.argmax(-1)))
        top = drafter.to_vocab_ids(logits.topk(widest).indices).tolist() if widest > 1 else [best]
        for k in list(alive):
            if want == best or (k > 1 and want in top[:k]):
                counts[k] += 1
            else:
                alive.discard(k)
        if not alive:
            break
        if d + 1 < room:
            state = drafter(state, ids[last + d].view(1, 1), positions[:, p + 1 + d:p + 2 + d], cache)
    return counts


@torch.no_grad()
def chain_accepted_lengths(drafter, features: torch.Tensor, ids: torch.Tensor, prompt_length: int,
                           depth: int, top_k: int = 1) -> list[int]:
    """Accepted draft tokens per verification step along `ids` (prompt + the base's greedy continuation).
    `top_k > 1`: a token counts when it is among the drafter's k most likely at its depth (the drafter then reads
    it): the acceptance of a full tree of width k, an upper bound for any tree drafted from the same drafter."""
    n = len(ids)
    if n - prompt_length < 2:
        return []
    along = _drafter_context(drafter, features, ids)
    accepted, last = [], prompt_length + 1  # the prompt pass decoded token `prompt_length`
    while last < n:
        count = _tree_accepted(drafter, along, ids, last, depth, (top_k,))[top_k]
        accepted.append(count)
        last += count + 1
    return accepted


@torch.no_grad()
def tree_accepted_by_position(drafter, features, ids: torch.Tensor, prompt_length: int, depth: int,
                              top_ks=(1,)) -> dict[int, list[int]]:
    """`{k: accepted}`: what a full top-k tree of the drafter (see `chain_accepted_lengths`) accepts at every step
    start `last` from `prompt_length + 1` on (`accepted[last - prompt_length - 1]`), whichever steps came before:
    what `walk` combines with other drafts."""
    out = {k: [] for k in top_ks}
    if len(ids) - prompt_length < 2:
        return out
    along = _drafter_context(drafter, features, ids)
    for last in range(prompt_length + 1, len(ids)):
        for k, count in _tree_accepted(drafter, along, ids, last, depth, top_ks).items():
            out[k].append(count)
    return out


@torch.no_grad()
def block_accepted_by_position(block_drafter, features: torch.Tensor, ids: torch.Tensor, prompt_length: int
                               ) -> list[int]:
    """What a heads drafter's drafted block (`hf_bpd.generation.drafting.BlockDrafter.drafts`: its rescored paths
    and prompt lookup's copy in its node budget, every node verified) accepts at every step start `last` (as
    `tree_accepted_by_position`): the longest of its drafts' prefixes that the continuation follows."""
    if isinstance(features, dict):
        features = features["hidden_-1"]
    reference = ids.tolist()
    block_drafter.rescorer.reset()
    out = []
    for last in range(prompt_length + 1, len(ids)):
        drafts, _ = block_drafter.drafts(features[last - 2], reference[:last], len(ids) - last)
        out.append(max((accepted_length(d, reference[last:]) for d in drafts), default=0))
    return out


def walk(accepted: list[int]) -> tuple[int, list[int]]:
    """`(new tokens, accepted lengths per step)`, for `block_efficiency`, of greedy decoding whose step after new
    token `j` accepts `accepted[j]` draft tokens (by position, as `tree_accepted_by_position` gives them; the best of
    several drafters' per position is their drafts verified together): the steps of
    `hf_bpd.evaluation.analysis.simulated_steps`."""
    new_tokens = len(accepted) + 1
    return new_tokens, [accepted[j] for j in simulated_steps(accepted, new_tokens)]


def block_efficiency(runs: list[tuple[int, list[int]]]) -> float:
    """Pooled over prompts, each `(new tokens, accepted lengths per step)`: new tokens / serial calls (the prompt
    pass is one call)."""
    return sum(new for new, _ in runs) / max(sum(len(steps) + 1 for _, steps in runs), 1)


@torch.no_grad()
def heads_chain_accepted_lengths(heads, features: torch.Tensor, ids: torch.Tensor, prompt_length: int) -> list[int]:
    """The same for independent drafting heads (`hf_bpd.heads.DraftHeads`, vanilla BPD: each head's argmax): a
    step whose last token is at index L-1 drafts from the base's feature at L-2, head d guessing token L-1+d."""
    n = len(ids)
    if n - prompt_length < 2:
        return []
    dtype = next(heads.parameters()).dtype
    if isinstance(features, dict):
        features = features["hidden_-1"]
    guesses = heads.to_vocab_ids(heads(features.to(dtype)[None]).argmax(-1))[0].tolist()  # (heads, n)
    ids = ids.tolist()
    accepted, last = [], prompt_length + 1
    while last < n:
        p, count = last - 2, 0
        for d in range(min(len(guesses), n - last)):
            if guesses[d][p] != ids[last + d]:
                break
            count += 1
        accepted.append(count)
        last += count + 1
    return accepted


def read_references(path) -> list[tuple[torch.Tensor, int]]:
    """`(prompt + greedy continuation ids, prompt length)` per row of a references JSONL written by
    `benchmarks/draft_quality.py`."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(torch.tensor(r["ids"]), int(r["prompt_tokens"])) for r in rows]


@torch.no_grad()
def chain_block_efficiency(model, along: list[tuple[torch.Tensor, int, torch.Tensor]], depth: int = 4,
                           top_k: int = 1) -> float:
    """Block efficiency of `model`'s chain drafts (a `FeatureDrafter` at `depth`, or drafting heads: all of them)
    along `[(ids, prompt length, base features)]`."""
    runs = []
    for ids, n, feats in along:
        device = (feats["hidden_-1"] if isinstance(feats, dict) else feats).device
        if hasattr(model, "fuse"):
            steps = chain_accepted_lengths(model, feats, ids.to(device), n, depth, top_k)
        else:
            steps = heads_chain_accepted_lengths(model, feats, ids, n)
        runs.append((len(ids) - n, steps))
    return block_efficiency(runs)
