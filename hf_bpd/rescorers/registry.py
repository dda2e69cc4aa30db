"""The rescorer registry as users meet it: every registered name (the built-in `ngram` and `neural` included),
the class behind a name, and the `rescorer=` generation option resolved to an instance."""

from __future__ import annotations

from ..errors import BPDConfigError
from . import neural, ngram  # noqa: F401 - importing them registers the built-in rescorers
from .base import _REGISTRY, NO_RESCORER, HeadScoreRescorer, Rescorer


def available_rescorers() -> list[str]:
    """Names of every registered rescorer (the built-in `ngram` and `neural`, and any registered since)."""
    return sorted(_REGISTRY)


def rescorer_class(name: str) -> type[Rescorer]:
    if name not in available_rescorers():
        raise BPDConfigError(f"unknown rescorer {name!r}: use one of {', '.join(available_rescorers())}, "
                             f"{NO_RESCORER!r}, or register one with @hf_bpd.register_rescorer")
    return _REGISTRY[name]


def resolve_rescorer(rescorer, bundled: dict[str, Rescorer], model=None) -> Rescorer:
    """A `Rescorer` for the `rescorer` generation option: None/"none" (head scores), an instance, or a registered
    name (the checkpoint's bundled rescorer of that name, else the class's own `for_model`)."""
    if rescorer is None or rescorer == NO_RESCORER:
        return HeadScoreRescorer()
    if isinstance(rescorer, Rescorer):
        return rescorer
    if isinstance(rescorer, str):
        if rescorer in bundled:
            return bundled[rescorer]
        return rescorer_class(rescorer).for_model(model)
    raise BPDConfigError(f"rescorer must be a name ({', '.join(available_rescorers())}, {NO_RESCORER!r}), None or a "
                         f"hf_bpd.Rescorer instance, got {type(rescorer).__name__}")
