"""Head calibration: the measured chance that a drafted token is accepted, given its head's confidence in it.

`hf-bpd calibrate` (`hf_bpd.evaluation.calibration`) fits the table on held-out prompts and stores it in the
checkpoint's config (`head_calibration`); drafting ranks draft nodes by it (`drafting.best_first_nodes`) and the
controller (`hf_bpd.generation.controller`) weighs how many to verify with it.
"""

from __future__ import annotations

import bisect

from ..errors import BPDConfigError

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
