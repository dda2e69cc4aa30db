"""Drafted or plain steps (`draft_schedule="switch"`): within one call, decode plain one-token steps while drafting
does not pay, and draft again when it would.

A drafted step costs its drafting plus a forward over the block (`t_draft` ms) and yields `g` tokens (the accepted
draft tokens plus the base's own); a plain step costs one one-token forward (`t_plain` ms) and yields one token.
Drafting pays while `g / t_draft > 1 / t_plain`; the call leaves either mode only when the other is expected to
be `MARGIN` faster. Both times are the call's own measured step times (moving
averages; a plain step's starts from the compiled one-token step's timing, or the eager cost table, until one ran,
and is capped by a timed drafted step less its drafting: a one-token forward costs no more than a block's),
and `g` is a moving average of the tokens per drafted step, starting from `PRIOR_TOKENS`. The first drafted step of a
call is not timed (it carries one-off costs: caches cold after setup, first shapes), and a step timed over
`OUTLIER` times its mode's average counts as `OUTLIER` times it, so one slow step (a page-fault burst, the other
core busy) moves an average by a bounded amount and cannot lock the call out of drafting. So on text the drafts
predict well every step drafts (as `"fixed"`), and on text they predict badly the call falls back to plain steps
after a few drafted steps instead of paying for blocks that are mostly rejected.

While plain, every `PROBE_EVERY`-th step also drafts without verifying ("shadow" drafts, the drafting cost only);
once the plain steps have decoded as many tokens as the draft is long, the draft is scored against them (the tokens
a verification would have accepted, plus one) and the score updates `g`, so drafting resumes where the text turns
predictable (a list, code, a repeated passage). The switch changes which steps draft, never which tokens are
decoded: a plain step is the base's one-token forward through the same verifier.
"""

from __future__ import annotations

from .batch_width import shadow_accepted

PRIOR_TOKENS = 2.0  # tokens per drafted step assumed before any was measured: the call starts drafting
WEIGHT = 0.25  # moving averages: the weight of the newest step
MARGIN = 0.05  # leave a mode only when the other is expected to be 5 % faster (no flapping at break-even)
PROBE_EVERY = 6  # plain steps per shadow draft
OUTLIER = 2.0  # a step's time counts at most this multiple of its mode's average


class StepSwitch:
    """The per-call state of the switch (see the module docstring). `plain_ms`: the expected cost of a plain step
    before one is measured."""

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

    def _average(self, old: float, new: float) -> float:
        return (1 - WEIGHT) * old + WEIGHT * new

    def _time_average(self, old: float, new_ms: float) -> float:
        """A mode's step-time average after a step of `new_ms` (counted as `OUTLIER` times the average at most)."""
        return self._average(old, min(new_ms, OUTLIER * old))

    def _pays(self, margin: float) -> bool:
        if self.draft_ms is None:
            return True
        return self.gain / self.draft_ms > (1 + margin) / self.plain_ms

    def probe_due(self) -> bool:
        """Whether this plain step should also draft (a shadow draft): one every `PROBE_EVERY` plain steps, and none
        while the last one is still being scored."""
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
            self.gain = self._average(self.gain, tokens)
            self.drafted_steps += 1
            if self.drafted_steps > 1:  # the first carries one-off costs
                self.draft_ms = ms if self.draft_ms is None else self._time_average(self.draft_ms, ms)
                if not self.plain_measured:  # the prior may be stale: a plain step costs at most this step's rest
                    self.plain_ms = min(self.plain_ms, max(ms - 1000 * drafting_seconds, 1e-3))
        else:
            self.plain_measured = True
            self.plain_ms = self._time_average(self.plain_ms, ms)
            self.plain_steps += 1
            self._score_probe(decoded)
        before = self.drafting  # hysteresis: leave either mode only when the other is clearly faster
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
        accepted = max(shadow_accepted(list(d), actual)[1] for d in drafts)
        self.gain = self._average(self.gain, accepted + 1)
        self.probe = None
