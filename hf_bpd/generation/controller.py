"""How much to draft now: the one place that decides how many draft tokens a step verifies, for a lone sequence and
for a batch.

One rule decides everywhere. A step that verifies `n` draft tokens costs one base forward over its block plus the
drafting, and is expected to yield `E(n) = 1 + sum_{j<=n} prod_{i<=j} a_i` tokens (`expected_tokens`), where `a_i` is
the chance that draft token `i` is accepted once the ones before it were; the step verifies the `n` with the most
expected tokens per millisecond (`n = 0`: a plain one-token step). Where the estimates are noisy (running averages)
a wider choice must beat the narrower one by `MARGIN`: plain steps are exact and never slower than estimated. The
schedules differ only in where the rates and the costs come from:

| who | the rates `a_i` | the costs | decides |
| --- | --- | --- | --- |
| `draft_schedule="cost"` (`CostSchedule`) | the step's own drafts: calibrated head confidences (`calibration`) | `StepCosts` of the verifier's block lengths | each step's depth, or its node count |
| `draft_schedule="switch"` (`StepSwitch`) | the call's running tokens per drafted step | the call's running step times | whether a step drafts |
| a batch (`BatchWidth`) | each row's running acceptance per depth | `StepCosts`, refined by the call's own steps | every row's block width |

While plain steps run nothing is verified, so the switch and batches draft every `PROBE_EVERY`-th plain step without
verifying ("shadow" drafts) and score the drafts against the tokens decoded next (`shadow_accepted`): drafting
resumes where the text turns predictable. The costs are the machine's: the compiled block lengths' timings
(`execution.compiled_verification`), else the base's eager forwards (`eager_costs`, measured once per machine).
"""

from __future__ import annotations

import bisect

from .calibration import HeadCalibration, acceptance_rates

MARGIN = 0.05  # a wider choice must beat the narrower one by this share where estimates are running averages
WEIGHT = 0.3  # the newest observation's weight in every running average (tokens per step, step times, drafting)
TIMING_WEIGHT = WEIGHT  # the call's own step timings in a batch's cost model (0: the measured table only)
START_RATE = 0.5  # a draft token's acceptance rate before any was measured
PRIOR_TOKENS = 1 / (1 - START_RATE)  # tokens per drafted step assumed before one was measured: an unbounded chain
PROBE_EVERY = 8  # plain steps between shadow drafts
OUTLIER = 2.0  # a step's time counts at most this multiple of its mode's average (one slow step moves it boundedly)
PRIOR = 4.0  # pseudo-observations of the batch's pooled rate in each row's rate
CONFIDENCE = 0.5  # standard errors a row's rate is lowered by in a batch's width choice (its slowest row sets the end)
PROBE_ROWS = 4  # rows a batch's probe drafts at most: those probed longest ago (probing every row costs much)
HOPELESS = 0.85  # no drafted width within this share of a plain step's pace: the batch probes 4x less often
GUARD_STEPS = 4  # steps of each kind (plain, drafted) before a batch compares their realized rates
GUARD_MARGIN = 0.25  # the margin a wider block must clear while a batch's drafted steps deliver less than plain ones
REALIZED_DECAY = 0.9  # weight of the earlier steps in a batch's realized rates
FAR = 10_000  # the tokens left to rows whose remaining length is not given
COST_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # eager forwards measured for the tables (interpolated between)


def running(old: float, new: float) -> float:
    """A running average after one more observation."""
    return (1 - WEIGHT) * old + WEIGHT * new


def expected_tokens(rates: list[float]) -> list[float]:
    """`E(0), E(1), ...`: the tokens a step verifying the first `n` draft tokens is expected to yield."""
    out, chain = [1.0], 1.0
    for rate in rates:
        chain *= rate
        out.append(out[-1] + chain)
    return out


def shadow_accepted(draft: list[int], decoded: list[int]) -> tuple[int, int]:
    """`(tried, accepted)` of a shadow draft against the tokens decoded after it (tokens past them not counted)."""
    tried = min(len(draft), len(decoded))
    accepted = 0
    while accepted < tried and draft[accepted] == decoded[accepted]:
        accepted += 1
    return tried, accepted


def eager_costs(base, max_tokens: int, past: int = 128, repeats: int = 3) -> dict[int, float]:
    """`{n: ms}` of the base's eager forward of `n` tokens at `COST_LENGTHS` below `max_tokens` and `max_tokens`
    itself (`execution.eager_costs_at`: the stored `hf-bpd profile` table, else the lengths measured before on this
    machine, else measured now). `StepCosts` prices every other length from them."""
    from ..runtime.execution import eager_costs_at

    lengths = sorted({max_tokens, *(n for n in COST_LENGTHS if n < max_tokens)})
    return eager_costs_at(base, lengths, past=past, repeats=repeats)


class StepCosts:
    """The cost model: ms of one base forward over `n` tokens (every row's block of a step) on this machine.

    From measured `{n: ms}` (at least `n = 1`). A longer block is never charged less than a shorter one: measured
    costs of nearly equal lengths differ by noise, and noise must not make verifying more look cheaper. A compiled
    verifier pads a block to the next length it runs (`charge`); other lengths are interpolated (`__call__`), and a
    batch's own steps refine them (`timing`: a batch's forward costs more than one sequence's of as many tokens)."""

    def __init__(self, costs: dict[int, float]):
        if 1 not in costs:
            raise ValueError("the cost table needs the one-token forward")
        self.lengths, self.table, highest = sorted(costs), [], 0.0
        for n in self.lengths:
            highest = max(highest, float(costs[n]))
            self.table.append(highest)
        self.timed: dict[int, float] = {}  # n -> running ms of this call's own steps
        self.scale = 1.0  # running ratio of measured step times to the table's
        self.steps_timed = 0

    def charge(self, length: int) -> float | None:
        """The ms of the cheapest measured length that holds `length` tokens (None when none does)."""
        fit = bisect.bisect_left(self.lengths, length)
        return None if fit == len(self.lengths) else self.table[fit]

    def tabled(self, n: int) -> float:
        """The table's ms for `n` tokens (linear between its lengths, and past the last one)."""
        lengths, table = self.lengths, self.table
        i = bisect.bisect_left(lengths, n)
        if i < len(lengths) and lengths[i] == n:
            return table[i]
        if i == 0:
            return table[0]
        if i == len(lengths):  # past the table: the last segment's slope
            if len(lengths) == 1:
                return table[0] * n
            return table[-1] + (table[-1] - table[-2]) / (lengths[-1] - lengths[-2]) * (n - lengths[-1])
        share = (n - lengths[i - 1]) / (lengths[i] - lengths[i - 1])
        return table[i - 1] + share * (table[i] - table[i - 1])

    def __call__(self, n: int) -> float:
        """ms of a step over `n` tokens: this call's timing of `n` when there is one, else the table's (scaled)."""
        return self.timed[n] if n in self.timed else self.scale * self.tabled(n)

    def timing(self, n: int, ms: float) -> None:
        """A step over `n` tokens took `ms`."""
        self.steps_timed += 1
        if TIMING_WEIGHT <= 0:
            return
        ratio = ms / max(self.tabled(n), 1e-6)
        before = self.timed.get(n)
        self.timed[n] = ms if before is None else (1 - TIMING_WEIGHT) * before + TIMING_WEIGHT * ms
        self.scale = ratio if self.steps_timed == 1 else (1 - TIMING_WEIGHT) * self.scale + TIMING_WEIGHT * ratio


class CostSchedule:
    """`draft_schedule="cost"`: per step, verify only the drafted tokens that pay for themselves. The rates are the
    step's drafts' head confidences mapped through the checkpoint's calibration (raw without one); `overhead_ms` is
    the call's measured drafting time per step. With a node budget the nodes, ranked by their chance of being
    accepted (`drafting.best_first_nodes`), are weighed instead of depths, at counts that fill a measured length."""

    def __init__(self, costs: dict[int, float], calibration: HeadCalibration | None = None):
        self.costs = StepCosts(costs)
        self.calibration = calibration

    def choose(self, probs: list[float], overhead_ms: float = 0.0, block_cost=None) -> int:
        """How many of the drafted tokens (head probabilities `probs`, in order) to verify; `block_cost(k)`: the
        block length verifying `k` of them needs (default `k + 1`)."""
        gains = expected_tokens(acceptance_rates(self.calibration, probs))
        best_k, best_value = 0, -1.0
        for k, expected in enumerate(gains):
            ms = self.costs.charge((k + 1) if block_cost is None else block_cost(k))
            if ms is None:
                break
            if expected / (ms + overhead_ms) > best_value:
                best_k, best_value = k, expected / (ms + overhead_ms)
        return best_k

    def choose_nodes(self, chances: list[float], overhead_ms: float = 0.0) -> int:
        """How many of the candidate nodes (each one's chance of being accepted, likeliest first) to verify: a block is
        charged at the cheapest measured length that holds it, so only counts that fill one (or take every node) are
        weighed."""
        best_n, best_value = 0, -1.0
        for n in sorted({min(length - 1, len(chances)) for length in self.costs.lengths}):
            value = (1.0 + sum(chances[:n])) / (self.costs.charge(n + 1) + overhead_ms)
            if value > best_value:
                best_n, best_value = n, value
        return best_n


class StepSwitch:
    """`draft_schedule="switch"`: drafted steps while they deliver more tokens per ms than plain ones would, plain
    one-token steps otherwise. `g` (`gain`) is the running tokens per drafted step, starting at `PRIOR_TOKENS`; the
    step times are the call's own (a plain step's starts at `plain_ms`, the compiled one-token step's timing or the
    eager table, and is capped by a drafted step less its drafting until one ran). The first drafted step is not
    timed (one-off costs), and a step's time counts at most `OUTLIER` times its mode's average. While plain, shadow
    drafts update `g`. The switch changes which steps draft, never which tokens are decoded."""

    def __init__(self, plain_ms: float):
        self.gain = PRIOR_TOKENS
        self.plain_ms = float(plain_ms)
        self.draft_ms: float | None = None  # measured from the second drafted step on
        self.drafted_steps = 0
        self.plain_measured = False
        self.drafting = True
        self.plain_steps = 0  # since the last shadow draft
        self.probe: tuple[list[tuple[int, ...]], int] | None = None  # (drafts, where they start in the tokens)
        self.switches = 0

    def _pays(self, margin: float) -> bool:
        return self.draft_ms is None or self.gain / self.draft_ms > (1 + margin) / self.plain_ms

    def probe_due(self) -> bool:
        """Whether this plain step should also draft (a shadow draft), none while the last one is being scored."""
        return not self.drafting and self.probe is None and self.plain_steps >= PROBE_EVERY

    def start_probe(self, drafts: list[tuple[int, ...]], decoded: int) -> None:
        """A shadow draft of the tokens after the first `decoded` ones."""
        self.plain_steps = 0
        if drafts:
            self.probe = ([tuple(d) for d in drafts], decoded)

    def record(self, drafted: bool, tokens: int, seconds: float, decoded: list[int],
               drafting_seconds: float = 0.0) -> None:
        """After a step: whether it drafted, the tokens it decoded, its time, every token decoded so far, and the
        part of its time spent drafting."""
        ms = 1000 * seconds
        if drafted:
            self.gain = running(self.gain, tokens)
            self.drafted_steps += 1
            if self.drafted_steps > 1:  # the first carries one-off costs
                self.draft_ms = ms if self.draft_ms is None else running(self.draft_ms, min(ms, OUTLIER * self.draft_ms))
                if not self.plain_measured:  # the prior may be stale: a plain step costs at most this step's rest
                    self.plain_ms = min(self.plain_ms, max(ms - 1000 * drafting_seconds, 1e-3))
        else:
            self.plain_measured = True
            self.plain_ms = running(self.plain_ms, min(ms, OUTLIER * self.plain_ms))
            self.plain_steps += 1
            self._score_probe(decoded)
        before = self.drafting  # leave either mode only when the other is clearly faster
        self.drafting = self._pays(-MARGIN) if self.drafting else self._pays(MARGIN)
        self.switches += before != self.drafting

    def _score_probe(self, decoded: list[int]) -> None:
        if self.probe is None:
            return
        drafts, start = self.probe
        longest = max(len(d) for d in drafts)
        if len(decoded) - start < longest + 1:  # the bonus token after a fully accepted draft too
            return
        actual = decoded[start:start + longest]
        self.gain = running(self.gain, max(shadow_accepted(list(d), actual)[1] for d in drafts) + 1)
        self.probe = None


class BatchWidth:
    """The block width `W` of a batch's step (the last token plus up to `W - 1` draft nodes per row; 1: plain).

    A step costs `costs(rows * W)` plus drafting the rows; row `r` gains `E_r(W)` tokens from it at its running
    acceptance per depth (`rates`). A batch ends with its slowest row and finished rows leave, so each step takes
    the width that, held from now on, finishes every row soonest (`finish_ms`); a wider block must beat the best
    narrower one by `MARGIN` (`GUARD_MARGIN` while this call's drafted steps delivered fewer tokens per ms than its
    plain ones, `losing`). The first step is plain: it measures what a step of this batch costs. Every
    `PROBE_EVERY`-th plain step (4x rarer while no width comes within `HOPELESS` of paying) drafts shadow drafts for
    the `PROBE_ROWS` rows probed longest ago.

    Args:
        costs: `{n: ms}` forward costs (at least `n = 1`).
        max_width: the widest block the drafter fills (its last token plus its drafts).
        rows: the batch's rows (row indices stay fixed as rows leave).
    """

    def __init__(self, costs: dict[int, float], max_width: int, rows: int):
        self.costs = StepCosts(costs)
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
        self.probes = 0
        self.last_probed = [0] * rows  # per row: the probe that last drafted it (0: none)

    def pooled(self) -> list[float]:
        """The batch's acceptance rate per depth (every row's counts, shrunk towards `START_RATE`)."""
        return [(sum(h[d] for h in self.hits) + PRIOR * START_RATE) / (sum(t[d] for t in self.tries) + PRIOR)
                for d in range(len(self.tries[0]))]

    def rates(self, row: int, pooled: list[float] | None = None) -> list[float]:
        """Row `row`'s acceptance rate per depth: its counts shrunk towards the pooled rate (`PRIOR`), less
        `CONFIDENCE` standard errors of that estimate."""
        pooled = self.pooled() if pooled is None else pooled
        out = []
        for hits, tries, rate in zip(self.hits[row], self.tries[row], pooled):
            seen = tries + PRIOR
            mean = (hits + PRIOR * rate) / seen
            out.append(max(mean - CONFIDENCE * (mean * (1 - mean) / seen) ** 0.5, 0.0))
        return out

    def gains(self, row: int, pooled: list[float] | None = None) -> list[float]:
        """Tokens row `row` is expected to gain from a block of width 1, 2, ... `max_width`."""
        out = expected_tokens(self.rates(row, pooled)[: self.max_width - 1])
        return out + [out[-1]] * (self.max_width - len(out))

    def drafting_cost(self, rows: int) -> float:
        """ms that drafting `rows` rows is expected to take: the running per-row time of this call's drafted steps,
        or, before one has run, of its shadow probes (one path a row: a lower bound)."""
        return rows * (self.drafting_row_ms or self.probe_row_ms)

    def finish_ms(self, gains: list[float], remaining: list[int], width: int, computed=None) -> float:
        """ms to finish every row at blocks of `width`: row `i` gains `gains[i]` tokens a step of the `remaining[i]`
        it may still decode; rows leave as they finish, and a step costs the forward over `computed(active rows)` rows
        (default: the active ones) times `width`, plus drafting the active rows when `width > 1`."""
        computed = computed or (lambda active: active)
        finish = sorted(left / gain for left, gain in zip(remaining, gains))
        total, before = 0.0, 0.0
        for k, steps in enumerate(finish):
            active = len(finish) - k
            drafting = self.drafting_cost(active) if width > 1 else 0.0
            total += (steps - before) * (self.costs(computed(active) * width) + drafting)
            before = steps
        return total

    def choose(self, rows: list[int], remaining: list[int] | None = None, computed=None) -> int:
        """The block width for a step of `rows`; `remaining[i]`: the tokens row `rows[i]` may still decode;
        `computed(active)`: the rows a step computes while `active` are left (a compiled batch's finished rows ride
        along until they fit a smaller runner)."""
        if self.costs.steps_timed == 0:  # the table is one sequence's: a first plain step measures a batch's
            self.hopeless = False
            return 1
        remaining = [FAR] * len(rows) if remaining is None else remaining
        plain = self.finish_ms([1.0] * len(rows), remaining, 1, computed)
        best, best_ms, drafted = 1, plain, float("inf")
        pooled = self.pooled()
        gains = [self.gains(r, pooled) for r in rows]
        margin = GUARD_MARGIN if self.losing() else MARGIN
        for w in range(2, self.max_width + 1):
            ms = self.finish_ms([g[w - 1] for g in gains], remaining, w, computed)
            if ms * (1 + margin) < best_ms:
                best, best_ms = w, ms
            drafted = min(drafted, ms)
        self.hopeless = plain < HOPELESS * drafted
        return best

    def delivered(self, width: int, tokens: float, ms: float) -> None:
        """A step of `width` gave the rows `tokens` new tokens each on average in `ms` (its drafting added)."""
        rate = self.realized[1 if width > 1 else 0]
        ms += self.last_drafting_ms
        rate[0], rate[1], rate[2] = REALIZED_DECAY * rate[0] + tokens, REALIZED_DECAY * rate[1] + ms, rate[2] + 1

    def losing(self) -> bool:
        """Whether this call's drafted steps delivered fewer tokens per ms than its plain steps (`GUARD_STEPS` of
        each at least)."""
        (plain_tokens, plain_ms, plain_n), (tokens, ms, n) = self.realized
        return plain_n >= GUARD_STEPS and n >= GUARD_STEPS and tokens / ms < plain_tokens / plain_ms

    def probe_due(self) -> bool:
        """Whether this plain step should draft anyway (shadow drafts)."""
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
        as shadow drafts), None when they did not draft. Drafted steps and probes keep their own per-row times."""
        self.last_drafting_ms = drafting_ms or 0.0
        if drafting_ms is not None:
            name = "drafting_row_ms" if width > 1 else "probe_row_ms"
            per_row, before = drafting_ms / max(rows, 1), getattr(self, name)
            setattr(self, name, per_row if before == 0.0 else running(before, per_row))
        self.plain_steps = 0 if width > 1 or drafting_ms is not None else self.plain_steps + 1

    def record(self, row: int, tried: int, accepted: int) -> None:
        """Row `row` had `tried` draft tokens checked (verified, or shadow drafts) and the first `accepted` matched."""
        for d in range(min(tried, len(self.tries[row]))):
            self.tries[row][d] += 1
            if d < accepted:
                self.hits[row][d] += 1
            else:
                break
