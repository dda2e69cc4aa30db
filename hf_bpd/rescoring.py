"""Rescorers: turn a step's top-k lattice into the draft(s) to verify (paper Sec. 7).

A rescorer sees the lattice and the tokens decoded so far and returns up to `num_drafts` drafts, best first.
`generate(..., rescorer=...)` takes a `Rescorer` instance or a name (`"ngram"`, `"neural"`) of a rescorer bundled with
the checkpoint.
"""

from __future__ import annotations

from .errors import BPDConfigError
from .lattice import Draft, Lattice

RESCORER_NAMES = ("ngram", "neural")


class Rescorer:
    """Base class. Subclasses implement `rescore`; `reset` is called at the start of every `generate()`."""

    def reset(self) -> None:
        pass

    def check_compatible(self, model) -> None:
        """Raise a one-line `BPDError` if this rescorer cannot serve `model` (e.g. another vocabulary)."""

    def rescore(self, lattice: Lattice, context: list[int], num_drafts: int) -> list[Draft]:
        """Return up to `num_drafts` drafts through `lattice`, best first.

        Args:
            lattice: top-k tokens and log-probabilities of each head (row `i` drafts the token `i + 2` steps ahead
                of the last token of `context`, whose own successor the base has already chosen).
            context: every token so far: prompt, decoded tokens, and (last) the base's next token.
            num_drafts: how many drafts the verifier takes.
        """
        raise NotImplementedError


class HeadScoreRescorer(Rescorer):
    """No rescoring: the `num_drafts` best lattice paths under the head scores alone (argmax drafts for p=1)."""

    def rescore(self, lattice: Lattice, context: list[int], num_drafts: int) -> list[Draft]:
        return lattice.best_paths(num_drafts)


def resolve_rescorer(rescorer, model) -> Rescorer:
    """A `Rescorer` for the `rescorer` argument of `generate()` (None, an instance, or a bundled rescorer's name)."""
    if rescorer is None:
        return HeadScoreRescorer()
    if isinstance(rescorer, Rescorer):
        return rescorer
    if isinstance(rescorer, str) and rescorer in RESCORER_NAMES:
        bundled = getattr(model, "bundled_rescorers", {}).get(rescorer)
        if bundled is None:
            raise BPDConfigError(
                f"this checkpoint bundles no {rescorer} rescorer: pass a Rescorer object "
                f"(e.g. rescorer=hf_bpd.{'NgramRescorer' if rescorer == 'ngram' else 'NeuralRescorer'}(...))"
            )
        return bundled
    raise BPDConfigError(f"unknown rescorer {rescorer!r}: use None, {', '.join(map(repr, RESCORER_NAMES))} or a "
                         "hf_bpd.Rescorer instance")
