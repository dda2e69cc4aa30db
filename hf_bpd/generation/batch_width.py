"""How many tokens each row of a batch verifies per step: the cost-aware switch of batched drafting.

A batched step verifies a block of `W` tokens per row (the row's last token and up to `W - 1` drafted ones, every
row padded to the same `W`), so it costs one base forward over `rows x W` tokens, `cost(rows * W)`. Row `r` is
expected to gain `E_r(W) = 1 + sum_{j < W} prod_{d <= j} p_{r,d}` tokens from it, where `p_{r,d}` is its running
rate of accepting its draft token at depth `d` once the ones before it were accepted. A batch runs until its slowest
row is done, and a row that is done leaves the step (at once on a prebuilt step's runner, whose rows are dynamic;
on a runner compiled per shape once the rows left fit one of a quarter as many rows). So each step takes the `W` that,
held from now on, finishes every row soonest (`finish_ms`): row `r` finishes after `left_r / E_r(W)` steps, and until
then each step costs `cost(computed * W)` for the rows the step computes plus `drafting` for the active rows; a wider
block only when it beats the best narrower one by `MARGIN`; `W = 1` is a plain step (nothing drafted, nothing
padded). A row that accepts nothing sets the pace of a batch whose rows all have as much left (every drafted step
then costs more for no sooner end); rows that accept much finish early and leave cheaper steps behind. `drafting` is
the running per-row time of this call's drafted steps' drafting (each row's drafter rescores its paths, a cost
growing with the depths it rescores), kept apart from the shadow probes' (every head and the rescoring of each
row's best path over all of them), which stand in only until a drafted step has run. On a CPU a forward's cost
grows with its tokens, so a large batch verifying long blocks loses to plain batched decoding; the switch verifies
the depths that pay, and none when none do.

The estimates can err where the realized steps do not: each step's tokens per row per millisecond (its drafting,
or a plain step's shadow drafts, included) go into two decaying rates, plain and drafted steps (`delivered`). While
the drafted steps deliver less than the plain ones (`losing`, after `GUARD_STEPS` of each), a wider block must beat
plain by `GUARD_MARGIN` instead of `MARGIN`.

The rates: each row counts, per depth, the draft tokens it had verified (`tries`) and accepted (`hits`), shrunk
towards the batch's pooled rate at that depth (`PRIOR` pseudo-observations; the batch's own towards `START_RATE`),
then lowered by `CONFIDENCE` standard errors of that estimate. A batch ends with its slowest row, and a row seen
little may be that row: on the mean rates a large batch drafts from its first steps on a pooled rate its slowest
rows do not reach (docs/performance.md, "Batches").
While plain steps run nothing is verified, so every `PROBE_EVERY`-th plain step (every `4 * PROBE_EVERY`-th while no
width comes within `HOPELESS` of paying) drafts anyway for the `PROBE_ROWS` rows probed longest ago (one batched
heads call, then each one's best path as its drafter rescores it: what a drafted step would verify first) and the
drafts are scored against the tokens the rows then decode ("shadow" drafts: counted like verified ones, at no
verification cost; a few rows a probe, in turn, since probing every row of a large batch costs a sizeable share of
a plain step). The first
step of a call is plain: it measures what a step of this batch costs before any width is weighed. The costs: the
base's eager forward of `n` tokens on this machine, measured once per process at a few lengths and interpolated
(`forward_costs`), then corrected by the call's own steps as they come in: a step's measured time (forward,
acceptance and cache bookkeeping; drafting is counted apart) replaces the figure for its `rows * W` (an exponential
average over its steps), and the table's other figures are scaled by the running ratio of measured to tabled time (a
batch's forward costs more than one sequence's of as many tokens: each row attends to its own cache).
"""

from __future__ import annotations

import bisect

import torch

PRIOR = 4.0  # pseudo-observations of the pooled rate in each row's rate
START_RATE = 0.5  # the pooled rate before anything was verified
CONFIDENCE = 0.5  # standard errors a row's rate is lowered by in the width choice (see `rates`)
PROBE_EVERY = 8  # plain steps between shadow drafts (4x as many while drafting is far from paying)
PROBE_ROWS = 4  # rows a probe drafts at most: those probed longest ago (`BatchWidth.probe_rows`)
HOPELESS = 0.85  # "far from paying": the best drafted width's tokens per ms under this share of a plain step's
MARGIN = 0.05  # a wider block must beat the best narrower one by this share (estimates err; plain is safe)
TIMING_WEIGHT = 0.3  # weight of a step's own timing in the running cost of its token count (0: the table only)
GUARD_STEPS = 4  # steps of each kind (plain, drafted) before their realized rates are compared
GUARD_MARGIN = 0.25  # the margin a wider block must clear while drafted steps deliver less than plain ones
REALIZED_DECAY = 0.9  # weight of the earlier steps in the realized rates
FAR = 10_000  # the tokens left to rows whose remaining length is not given
COST_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # forwards measured for the table (interpolated between)


def forward_costs(base, max_tokens: int) -> dict[int, float]:
    """`{n: ms}` of the base's eager forward of `n` tokens at `COST_LENGTHS` up to the first one covering
    `max_tokens` (`hf_bpd.runtime.execution.eager_costs_at`: the stored `hf-bpd profile` table where it has them, else
    measured now, once per process)."""
    from ..runtime.execution import eager_costs_at

    lengths = [n for n in COST_LENGTHS if n < max_tokens] + [next((n for n in COST_LENGTHS if n >= max_tokens),
                                                                  max_tokens)]
    return eager_costs_at(base, lengths, past=64, repeats=2)


class BatchWidth:
    """The per-step block width of a batch (see the module docstring).

    Args:
        costs: `{n: ms}` eager forward costs (at least `n = 1`), interpolated linearly between lengths.
        max_width: the widest block the drafter fills (its last token plus its drafts).
        rows: the batch's rows (row indices stay fixed as rows leave).
    """

    def __init__(self, costs: dict[int, float], max_width: int, rows: int):
        if 1 not in costs:
            raise ValueError("the cost table needs the one-token forward")
        self.lengths = sorted(costs)
        self.table = [costs[n] for n in self.lengths]
        self.timed: dict[int, float] = {}  # n -> running ms of this call's own steps
        self.scale = 1.0  # running ratio of measured step times to the table's
        self.steps_timed = 0
        self.max_width = max_width
        depths = max(max_width - 1, 1)
        self.tries = [[0] * depths for _ in range(rows)]
        self.hits = [[0] * depths for _ in range(rows)]
        self.plain_steps = 0  # plain steps since the last drafted or probed one
        self.drafting_row_ms = 0.0  # running ms per row of a drafted step's drafting (the drafter's full work)
        self.probe_row_ms = 0.0  # running ms per row of a plain step's shadow drafts (one path a row)
        self.hopeless = False  # whether the last choice found every drafted width far from paying
        self.last_drafting_ms = 0.0  # what the last step's drafting took (0: none)
        self.realized = [[0.0, 0.0, 0], [0.0, 0.0, 0]]  # plain, drafted steps: decaying tokens, ms; steps
        self.probes = 0  # probes so far
        self.last_probed = [0] * rows  # per row: the probe that last drafted it (0: none)

    def cost(self, n: int) -> float:
        """ms of a step over `n` tokens: this call's timing of `n` when there is one, else the table's (scaled)."""
        if n in self.timed:
            return self.timed[n]
        return self.scale * self.tabled(n)

    def tabled(self, n: int) -> float:
        """The table's ms for a forward over `n` tokens (linear between its lengths, and past the last one)."""
        lengths, table = self.lengths, self.table
        i = bisect.bisect_left(lengths, n)
        if i < len(lengths) and lengths[i] == n:
            return table[i]
        if i == 0:
            return table[0]
        if i == len(lengths):  # past the table: the last segment's slope
            if len(lengths) == 1:
                return table[0] * n
            slope = (table[-1] - table[-2]) / (lengths[-1] - lengths[-2])
            return table[-1] + slope * (n - lengths[-1])
        share = (n - lengths[i - 1]) / (lengths[i] - lengths[i - 1])
        return table[i - 1] + share * (table[i] - table[i - 1])

    def timing(self, n: int, ms: float) -> None:
        """A step over `n` tokens took `ms` (this call's own steps refine the table)."""
        self.steps_timed += 1
        if TIMING_WEIGHT <= 0:
            return
        ratio = ms / max(self.tabled(n), 1e-6)
        before = self.timed.get(n)
        self.timed[n] = ms if before is None else (1 - TIMING_WEIGHT) * before + TIMING_WEIGHT * ms
        self.scale = ratio if self.steps_timed == 1 else (1 - TIMING_WEIGHT) * self.scale + TIMING_WEIGHT * ratio

    def pooled(self) -> list[float]:
        """The batch's acceptance rate per depth (every row's counts, shrunk towards `START_RATE`)."""
        return [(sum(h[d] for h in self.hits) + PRIOR * START_RATE) / (sum(t[d] for t in self.tries) + PRIOR)
                for d in range(len(self.tries[0]))]

    def rates(self, row: int, pooled: list[float] | None = None) -> list[float]:
        """Row `row`'s acceptance rate per depth, shrunk towards the batch's pooled rate, less `CONFIDENCE` standard
        errors of that estimate (`tries + PRIOR` observations)."""
        pooled = self.pooled() if pooled is None else pooled
        out = []
        for hits, tries, rate in zip(self.hits[row], self.tries[row], pooled):
            seen = tries + PRIOR
            mean = (hits + PRIOR * rate) / seen
            out.append(max(mean - CONFIDENCE * (mean * (1 - mean) / seen) ** 0.5, 0.0))
        return out

    def gains(self, row: int, pooled: list[float] | None = None) -> list[float]:
        """Tokens row `row` is expected to gain from a block of width 1, 2, ... `max_width`."""
        out, chain = [1.0], 1.0
        for rate in self.rates(row, pooled)[: self.max_width - 1]:
            chain *= rate
            out.append(out[-1] + chain)
        return out + [out[-1]] * (self.max_width - len(out))

    def expected(self, row: int, width: int) -> float:
        """Tokens row `row` is expected to gain from a block of `width`."""
        return self.gains(row)[width - 1]

    def drafting_cost(self, rows: int) -> float:
        """ms that drafting `rows` rows for a drafted step is expected to take: the running per-row time of this
        call's drafted steps, or, before one has run, of its shadow probes (one path a row: a lower bound)."""
        return rows * (self.drafting_row_ms or self.probe_row_ms)

    def finish_ms(self, gains: list[float], remaining: list[int], width: int, computed=None) -> float:
        """ms to finish every row at blocks of `width` (see the module docstring): row `i` gains `gains[i]` tokens a
        step of the `remaining[i]` it may still decode; rows leave as they finish, and a step costs the forward over
        `computed(active rows)` rows (the rows a step computes while that many are active; default: the active ones)
        times `width`, plus drafting the active rows when `width > 1`."""
        computed = computed or (lambda active: active)
        finish = sorted(left / gain for left, gain in zip(remaining, gains))
        total, before = 0.0, 0.0
        for k, steps in enumerate(finish):
            active = len(finish) - k
            drafting = self.drafting_cost(active) if width > 1 else 0.0
            total += (steps - before) * (self.cost(computed(active) * width) + drafting)
            before = steps
        return total

    def choose(self, rows: list[int], remaining: list[int] | None = None, computed=None) -> int:
        """The block width for a step of `rows` (1: a plain step): the one that finishes every row soonest
        (`finish_ms`); `remaining[i]` is how many tokens row `rows[i]` may still decode; `computed(active)`: the rows a
        step computes while `active` rows are left (a compiled batch's finished rows ride along until they fit a
        smaller runner). A drafted width is charged what drafting the rows costs (`drafting_cost`)."""
        if self.steps_timed == 0:  # the table is one sequence's: a first plain step measures what a batch costs
            self.hopeless = False
            return 1
        if remaining is None:  # far from done
            remaining = [FAR] * len(rows)
        plain = self.finish_ms([1.0] * len(rows), remaining, 1, computed)
        best, best_ms, drafted = 1, plain, float("inf")
        pooled = self.pooled()
        gains = [self.gains(r, pooled) for r in rows]
        # drafted steps that delivered fewer tokens per ms than plain ones in this call: only a clear win drafts
        margin = GUARD_MARGIN if self.losing() else MARGIN
        for w in range(2, self.max_width + 1):
            ms = self.finish_ms([g[w - 1] for g in gains], remaining, w, computed)
            if ms * (1 + margin) < best_ms:
                best, best_ms = w, ms
            drafted = min(drafted, ms)
        self.hopeless = plain < HOPELESS * drafted  # no width came close: probe less often
        return best

    def delivered(self, width: int, tokens: float, ms: float) -> None:
        """A step of `width` gave the rows `tokens` new tokens each on average in `ms`, drafting included (a plain
        step's shadow drafts too): the realized rates `losing` compares."""
        kind = 1 if width > 1 else 0
        ms += self.last_drafting_ms
        rate = self.realized[kind]
        rate[0], rate[1], rate[2] = REALIZED_DECAY * rate[0] + tokens, REALIZED_DECAY * rate[1] + ms, rate[2] + 1

    def losing(self) -> bool:
        """Whether this call's drafted steps delivered fewer tokens per ms than its plain steps (each rate a decaying
        sum over its steps; at least `GUARD_STEPS` of each)."""
        (plain_tokens, plain_ms, plain_n), (tokens, ms, n) = self.realized
        if plain_n < GUARD_STEPS or n < GUARD_STEPS:
            return False
        return tokens / ms < plain_tokens / plain_ms

    def probe_due(self) -> bool:
        """Whether this plain step should draft anyway (shadow drafts, see the module docstring)."""
        return self.plain_steps + 1 >= (PROBE_EVERY * 4 if self.hopeless else PROBE_EVERY)

    def probe_rows(self, rows: list[int]) -> list[int]:
        """The rows of `rows` a due probe drafts: the `PROBE_ROWS` probed longest ago (ties in the given order)."""
        chosen = sorted(rows, key=lambda row: self.last_probed[row])[:PROBE_ROWS]
        self.probes += 1
        for row in chosen:
            self.last_probed[row] = self.probes
        return chosen

    def stepped(self, width: int, drafting_ms: float | None, rows: int = 1) -> None:
        """A step of `width` over `rows` rows ran; `drafting_ms`: what drafting its rows took (for verification, or
        as a plain step's shadow drafts), None when they did not draft. Drafted steps and probes keep their own
        per-row times: a drafted step's drafter fills each row's node budget, a probe drafts one path a row."""
        self.last_drafting_ms = drafting_ms or 0.0
        if drafting_ms is not None:
            name = "drafting_row_ms" if width > 1 else "probe_row_ms"
            per_row, before = drafting_ms / max(rows, 1), getattr(self, name)
            setattr(self, name, per_row if before == 0.0 else 0.7 * before + 0.3 * per_row)
        self.plain_steps = 0 if width > 1 or drafting_ms is not None else self.plain_steps + 1

    def record(self, row: int, tried: int, accepted: int) -> None:
        """Row `row` had `tried` draft tokens checked (verified, or shadow drafts against its next tokens) and the
        first `accepted` of them matched."""
        for d in range(min(tried, len(self.tries[row]))):
            self.tries[row][d] += 1
            if d < accepted:
                self.hits[row][d] += 1
            else:
                break


def shadow_accepted(draft: list[int], decoded: list[int]) -> tuple[int, int]:
    """`(tried, accepted)` of a shadow draft against the tokens the row decoded after it (for `BatchWidth.record`):
    tokens past what it decoded are not counted."""
    tried = min(len(draft), len(decoded))
    accepted = 0
    while accepted < tried and draft[accepted] == decoded[accepted]:
        accepted += 1
    return tried, accepted


@torch.no_grad()
def batch_chains(heads, hidden: torch.Tensor, num_heads: int) -> list[list[int]] | None:
    """Every row's draft chain (the heads' argmax tokens) from the rows' hidden states `(rows, hidden_size)`, in one
    batched heads call (a tied output projection read once for all heads and rows); None for sequential heads (each
    reads the previous head's token: drafted per row)."""
    if heads.sequential or num_heads <= 0:
        return None
    dtype = hidden.dtype
    states = [heads.heads[i](hidden.to(next(heads.parameters()).dtype)).to(dtype) for i in range(num_heads)]
    if heads.heads[0].projection is None:  # one product for every head
        logits = heads.project(0, torch.stack(states))
    else:
        logits = torch.stack([heads.project(i, state) for i, state in enumerate(states)])
    return heads.to_vocab_ids(logits.argmax(-1)).T.tolist()  # (rows, heads)
