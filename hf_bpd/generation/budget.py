"""Cost-aware drafting (`draft_schedule="cost"`): per step, verify only the drafted tokens that pay for themselves.

Verifying `k` drafted tokens costs one base forward over `k + 1` tokens, `cost(k + 1)`, and is expected to yield
`E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i` tokens, where `a_i` is the chance that draft token `i` is accepted once
the tokens before it were: the head's probability of the token it drafted, mapped through the checkpoint's
calibration table (`hf-bpd calibrate`: measured acceptance rates per head and confidence bin on held-out prompts;
the raw probability when the checkpoint has none). Each step takes the `k` with the most expected tokens per
millisecond, `E(k) / (cost(k + 1) + overhead)`, where `overhead` is the call's own measured drafting time per
step. `k = 0` is a plain one-token step. With a node budget (`draft_nodes`: the heads' paths and prompt lookup's copy
share the block) the nodes are weighed instead of depths (`DraftBudget.choose_nodes`): ranked by their chance of
being accepted, the likeliest `n` are verified, `n` filling one of the measured block lengths.

The costs come from the machine: for the compiled step, the timed forward of each compiled block length (measured
right after compiling it); eagerly, `hf-bpd profile`'s stored table for this model, dtype, CPU and thread count,
else a short measurement on first use (a few forwards per length, once per process).
"""

from __future__ import annotations

import bisect

import torch

from ..errors import BPDConfigError
from .config import SCHEDULES  # noqa: F401 - re-exported

# Prompt lookup's per-token acceptance rates when the checkpoint has no measured ones (`hf-bpd calibrate` measures
# them); only their order against the heads' rates matters for `best_first_nodes`.
DEFAULT_LOOKUP_RATES = [0.5, 0.7]


class HeadCalibration:
    """Measured acceptance rate of draft token `i` (given the ones before it were accepted) per confidence bin.

    `edges` are the upper bounds of the bins over the head's probability of its drafted token; `accept[i][b]` is
    head `i`'s acceptance rate in bin `b`. Saved in the checkpoint's config as `head_calibration`.
    """

    def __init__(self, edges: list[float], accept: list[list[float]], counts: list[list[int]] | None = None,
                 lookup: list[float] | None = None, ranks: list[float] | None = None):
        if not edges or any(len(row) != len(edges) for row in accept):
            raise BPDConfigError("head_calibration needs one acceptance rate per bin edge for every head")
        if lookup is not None and (not isinstance(lookup, list) or not all(0 <= r <= 1 for r in lookup)):
            raise BPDConfigError("head_calibration's lookup rates must be a list of numbers in [0, 1]")
        self.edges, self.accept, self.counts = list(edges), [list(r) for r in accept], counts
        if ranks is not None and (not isinstance(ranks, list) or not all(0 < r <= 1 for r in ranks)):
            raise BPDConfigError("head_calibration's rank factors must be a list of numbers in (0, 1]")
        self.lookup = lookup  # acceptance rate of prompt lookup's token j (given the ones before it were accepted)
        # p-best drafts: a token first drafted by the path of rank r >= 1 is accepted `ranks[r - 1]` times as often
        # as its head's confidence says (measured; the last factor repeats; 1.0 without)
        self.ranks = ranks

    @classmethod
    def default(cls) -> HeadCalibration:
        """No measured rates: raw head probabilities, `DEFAULT_LOOKUP_RATES` for prompt lookup."""
        return cls([1.0], [], None, None)

    def lookup_rates(self, n: int) -> list[float]:
        """Prompt lookup's per-token acceptance rates for an `n`-token copy (the last measured one repeats)."""
        rates = self.lookup or DEFAULT_LOOKUP_RATES
        return [rates[min(j, len(rates) - 1)] for j in range(n)]

    def rank_factor(self, rank: int) -> float:
        """How much less often a token of the `rank`-th best path (0: the best) is accepted than its confidence
        says (`ranks`; 1.0 when not measured)."""
        if rank == 0 or not self.ranks:
            return 1.0
        return self.ranks[min(rank, len(self.ranks)) - 1]

    def bin(self, prob: float) -> int:
        return min(bisect.bisect_left(self.edges, prob), len(self.edges) - 1)

    def rate(self, head: int, prob: float) -> float:  # noqa: D102 - raw `prob` for heads without a row
        return prob if head >= len(self.accept) else self.accept[head][self.bin(prob)]

    def to_dict(self) -> dict:
        out = {"edges": self.edges, "accept": self.accept}
        if self.counts is not None:
            out["counts"] = self.counts
        if self.lookup is not None:
            out["lookup"] = self.lookup
        if self.ranks is not None:
            out["ranks"] = self.ranks
        return out

    @classmethod
    def from_dict(cls, values: dict | None) -> HeadCalibration | None:
        if not values:
            return None
        if not isinstance(values, dict) or not isinstance(values.get("edges"), list) or \
                not isinstance(values.get("accept"), list):
            raise BPDConfigError("head_calibration must be {'edges': [...], 'accept': [[...] per head]}: rerun "
                                 "hf-bpd calibrate, or drop it")
        return cls(values["edges"], values["accept"], values.get("counts"), values.get("lookup"), values.get("ranks"))

    @classmethod
    def fit(cls, records: list[tuple[int, float, bool]], num_heads: int, bins: int = 10,
            prior: float = 2.0, lookup_records: list[tuple[int, bool]] | None = None,
            rank_records: list[tuple[int, int, float, bool]] | None = None, max_rank: int = 2) -> HeadCalibration:
        """From `(head, probability, accepted)` records: equal-width bins, each rate shrunk towards the bin's
        mean probability by `prior` pseudo-observations (so a sparse bin stays near the raw probability).

        `lookup_records` `(position, accepted)` give prompt lookup's per-position rates; `rank_records` `(rank,
        head, probability, accepted)` (tokens first drafted by the p-best path of that rank, tried) give one factor
        per rank 1 .. `max_rank` (higher ranks pooled into the last): accepted tokens over the fitted rates'
        expectation."""
        edges = [(b + 1) / bins for b in range(bins)]
        hits = [[0.0] * bins for _ in range(num_heads)]
        totals = [[0] * bins for _ in range(num_heads)]
        probs = [[0.0] * bins for _ in range(num_heads)]
        for head, prob, ok in records:
            b = min(bisect.bisect_left(edges, prob), bins - 1)  # as `bin`
            hits[head][b] += bool(ok)
            totals[head][b] += 1
            probs[head][b] += prob
        accept = []
        for h in range(num_heads):
            row = []
            for b in range(bins):
                centre = probs[h][b] / totals[h][b] if totals[h][b] else edges[b] - 0.5 / bins
                row.append(round((hits[h][b] + prior * centre) / (totals[h][b] + prior), 4))
            accept.append(row)
        lookup = None
        if lookup_records:
            length = max(j for j, _ in lookup_records) + 1
            tries, hits = [0] * length, [0] * length
            for j, ok in lookup_records:
                tries[j] += 1
                hits[j] += bool(ok)
            lookup = [round((hits[j] + prior * 0.5) / (tries[j] + prior), 4) for j in range(length)]
        fitted = cls(edges, accept, totals, lookup)
        if rank_records:
            expected, accepted = [0.0] * max_rank, [0.0] * max_rank
            for rank, head, prob, ok in rank_records:
                if rank >= 1:
                    r = min(rank, max_rank) - 1
                    expected[r] += fitted.rate(head, prob)
                    accepted[r] += bool(ok)
            fitted.ranks = [round(min(1.0, max(0.01, (accepted[r] + prior * 0.5) / (expected[r] + prior))), 4)
                            for r in range(max_rank)]
        return fitted


def acceptance_rates(calibration: HeadCalibration | None, probs: list[float]) -> list[float]:
    """The calibrated acceptance rate of each drafted token from its head probability (raw without calibration)."""
    return list(probs) if calibration is None else [calibration.rate(i, p) for i, p in enumerate(probs)]


class DraftBudget:
    """Chooses how many drafted tokens to verify at each step (see the module docstring).

    Args:
        costs: `{block length: ms}` for the block lengths the verifier can run (at least length 1).
        calibration: `HeadCalibration` or None (raw head probabilities).
    """

    def __init__(self, costs: dict[int, float], calibration: HeadCalibration | None = None):
        if 1 not in costs:
            raise ValueError("the cost table needs the one-token forward")
        # A longer block is never charged less than a shorter one: measured costs of nearly equal lengths differ by
        # noise, and noise must not make verifying more drafted tokens look cheaper than verifying fewer.
        self.costs, highest = {}, 0.0
        for length, ms in sorted(costs.items()):
            highest = max(highest, float(ms))
            self.costs[length] = highest
        self.calibration = calibration

    def charge(self, length: int) -> float | None:
        """The ms of the cheapest measured block length that holds `length` tokens (None when none does)."""
        lengths = list(self.costs)  # sorted by length (`__init__`)
        fit = bisect.bisect_left(lengths, length)
        return None if fit == len(lengths) else self.costs[lengths[fit]]

    def choose(self, probs: list[float], overhead_ms: float = 0.0, block_cost=None) -> int:
        """How many of the drafted tokens (with head probabilities `probs`, in order) to verify.

        `block_cost(k)` gives the block length verifying `k` drafted tokens needs (default `k + 1`); lengths are
        charged at the cheapest measured length that holds them.
        """
        rates = acceptance_rates(self.calibration, probs)
        best_k, best_value, expected, chain = 0, -1.0, 1.0, 1.0
        for k in range(len(rates) + 1):
            if k > 0:
                chain *= rates[k - 1]
                expected += chain
            ms = self.charge((k + 1) if block_cost is None else block_cost(k))
            if ms is None:
                break
            value = expected / (ms + overhead_ms)
            if value > best_value:
                best_k, best_value = k, value
        return best_k

    def choose_nodes(self, chances: list[float], overhead_ms: float = 0.0) -> int:
        """How many draft nodes to verify, given every candidate node's chance of being accepted, likeliest first
        (`best_first_nodes`): the count with the most expected tokens, `1 + sum` of the chosen nodes' chances, per
        millisecond of its block. A block is charged at the cheapest measured length that holds it, so only counts
        that fill a measured length (or take every node) are weighed; 0 is a plain one-token step."""
        counts = sorted({min(length - 1, len(chances)) for length in self.costs})
        best_n, best_value = 0, -1.0
        for n in counts:
            value = (1.0 + sum(chances[:n])) / (self.charge(n + 1) + overhead_ms)
            if value > best_value:
                best_n, best_value = n, value
        return best_n


def eager_costs(base, max_length: int, past: int = 128, repeats: int = 3) -> dict[int, float]:
    """`{n: ms}` of eager base forwards of n = 1, 2, 4, ... and max_length tokens (`execution.eager_costs_at`: the
    stored `hf-bpd profile` table, else the lengths measured before on this machine, else measured now). A block
    is charged at the cheapest measured length that holds it (`DraftBudget.charge`), so these lengths price every
    block; measuring every length up to 8 would cost a call's first step seconds."""
    from ..runtime.execution import eager_costs_at

    lengths = sorted({max_length, *(2**i for i in range(max_length.bit_length()) if 2**i <= max_length)})
    return eager_costs_at(base, lengths, past=past, repeats=repeats)


def best_first_nodes(paths: list[tuple[tuple[int, ...], list[float]]], budget: int, count=None
                     ) -> list[tuple[int, ...]]:
    """At most `budget` draft nodes from several candidate chains, the likeliest to be accepted first.

    `paths` holds `(tokens, rates)`: a chain and each token's acceptance rate given the ones before it. A node (a
    prefix of a chain; chains sharing a prefix share its nodes) is worth the chance its whole prefix is accepted,
    the product of its rates (the best over the chains that hold it). The chance falls along every chain, so the
    `budget` most likely nodes form prefixes: they are returned as one draft per chain (its chosen prefix), ties
    going to the earlier chain. This is how prompt lookup's copy competes with the heads' chain for the same
    verification slots. `count(chances)`, given the chances of the `budget` likeliest nodes in order, may take fewer
    (`DraftBudget.choose_nodes`: `draft_schedule="cost"`).
    """
    value: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    for rank, (tokens, rates) in enumerate(paths):
        chance = 1.0
        for j in range(len(tokens)):
            chance *= rates[j]
            node = tuple(tokens[: j + 1])
            if chance > value.get(node, -1.0):
                value[node] = chance
            order.setdefault(node, rank)
    chosen = sorted(value, key=lambda node: (-value[node], order[node], len(node)))[: max(budget, 0)]
    if count is not None:
        chosen = chosen[: count([value[node] for node in chosen])]
    keep = set(chosen)
    # every chosen node's prefixes are chosen too (their chance is at least as large; ties resolved by length)
    leaves = [node for node in chosen if not any(other[: len(node)] == node and other != node for other in keep)]
    return sorted(leaves, key=lambda node: order[node])
