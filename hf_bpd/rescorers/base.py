"""Rescorers turn a step's top-k lattice into the draft(s) to verify (paper Sec. 7), and the registry of them.

A rescorer sees the lattice and the tokens decoded so far and returns up to `num_drafts` drafts, best first. Every
rescorer class is registered under a name with `@register_rescorer("name")`; that one line makes the name usable
everywhere: `generate(rescorer="name")`, `model.generation_config.rescorer`, `model.bundle_rescorer("name", path)`,
the CLI's `--rescorer`, the bench's `bpd+name` method, config validation and the model card.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ..errors import BPDConfigError
from ..limits import MAX_DRAFT_TOP_K, MAX_RESCORING_WORK
from ..lattice import Draft, Lattice

_REGISTRY: dict[str, type[Rescorer]] = {}
NO_RESCORER = "none"  # `rescorer="none"` (or None): the heads' own scores


class Rescorer:
    """Base class. Subclasses implement `rescore`; `reset` is called at the start of every `generate()`.

    A rescorer that can be bundled with a checkpoint (saved next to the heads, loaded with them) implements
    `from_bundle`; one that needs no file can be used by its registered name without bundling (`for_model`).
    """

    name: ClassVar[str | None] = None  # set by `register_rescorer`
    # Ceiling of `work(...)` (docs/reliability.md "Ceilings"): a call whose estimate exceeds it is refused up front.
    max_work: ClassVar[int] = MAX_RESCORING_WORK  # 64 (draft_top_k) x 64 (num_drafts) x 4 heads
    # Whether `from_bundle` hands its file to native code (not safetensors): such a file from the Hub needs a hash
    # pinned outside its repo (`hf_bpd.hub.bundled`).
    parses_natively: ClassVar[bool] = False

    @classmethod
    def for_model(cls, model) -> Rescorer:
        """The rescorer `generate(rescorer=name)` uses when the checkpoint bundles none of this name."""
        try:
            return cls()
        except TypeError:
            raise BPDConfigError(f"this checkpoint bundles no {cls.name} rescorer: bundle one with "
                                 f"model.bundle_rescorer({cls.name!r}, path) or pass a {cls.__name__} instance") from None

    @classmethod
    def from_bundle(cls, base_model, path: Path, alpha: float = 1.0, **fields) -> Rescorer:
        """Load the bundled rescorer stored at `path` (a file or directory inside the checkpoint)."""
        raise BPDConfigError(f"the {cls.name} rescorer cannot be bundled with a checkpoint: pass an instance instead")

    def reset(self) -> None:
        pass

    def for_call(self) -> Rescorer:
        """The rescorer one `generate()` call uses. A rescorer that keeps state between steps (a KV cache, ...)
        returns a fresh copy that shares its weights, so concurrent calls on one model never share that state;
        stateless rescorers return themselves."""
        return self

    def work(self, num_heads: int, top_k: int, num_drafts: int) -> int:
        """Estimated cost of one `rescore` call on a `(num_heads, top_k)` lattice for `num_drafts` drafts, in the
        units of `max_work`: lattice width x drafts x heads."""
        return num_heads * top_k * num_drafts

    def check_work(self, num_heads: int, top_k: int, num_drafts: int) -> None:
        """Raise a one-line `WorkLimitError` when `work(...)` exceeds `max_work` (before any decoding)."""
        from ..errors import WorkLimitError

        if top_k > MAX_DRAFT_TOP_K:  # the search's cost grows faster than linearly in the width
            raise WorkLimitError(f"draft_top_k={top_k} (the lattice width) is over the ceiling of {MAX_DRAFT_TOP_K}: "
                                 "lower draft_top_k")
        work, ceiling = self.work(num_heads, top_k, num_drafts), self.work_ceiling()
        if work > ceiling:
            label = self.name or type(self).__name__
            raise WorkLimitError(f"rescoring cost draft_top_k x num_drafts x heads = {top_k} x {num_drafts} x "
                                 f"{num_heads} = {work} is over the {label} rescorer's ceiling of {ceiling}"
                                 f"{self.work_note()}: lower draft_top_k or num_drafts (or num_heads_to_use)")

    def work_ceiling(self) -> int:
        return self.max_work

    def work_note(self) -> str:
        return ""

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


def register_rescorer(name: str):
    """Class decorator: register a `Rescorer` subclass under `name` (see the module docstring)."""
    if not isinstance(name, str) or not name or name == NO_RESCORER or "+" in name or "," in name:
        raise BPDConfigError(f"a rescorer name must be a non-empty string without '+' or ',', not {NO_RESCORER!r}; "
                             f"got {name!r}")

    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, Rescorer)):
            raise BPDConfigError(f"@register_rescorer({name!r}) decorates Rescorer subclasses, got {cls!r}")
        if _REGISTRY.get(name, cls) is not cls:
            raise BPDConfigError(f"a rescorer named {name!r} is already registered ({_REGISTRY[name].__name__}): "
                                 "choose another name")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register
