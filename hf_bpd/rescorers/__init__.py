"""Draft refinement (paper Sec. 7): rescorers pick drafts from the heads' top-k lattice.

`base` holds the `Rescorer` interface and `register_rescorer`; `registry` the names (`available_rescorers`) and the
`rescorer=` option resolved to an instance; `ngram` the
exact p-best n-gram rescorer (KenLM; `kenlm` installs, builds and compiles its fast path); `neural` the local
neural rescorer (Alg. 2). Adding a rescorer is one module with one `@register_rescorer("name")` class.
"""

import importlib

_LAZY = {"NO_RESCORER": "base", "HeadScoreRescorer": "base", "Rescorer": "base", "available_rescorers": "registry",
         "register_rescorer": "base", "rescorer_class": "registry", "resolve_rescorer": "registry", "build_ngram": "kenlm",
         "NeuralRescorer": "neural", "NgramRescorer": "ngram"}

__all__ = ["NO_RESCORER", "HeadScoreRescorer", "NeuralRescorer", "NgramRescorer", "Rescorer",
           "available_rescorers", "build_ngram", "register_rescorer", "rescorer_class", "resolve_rescorer"]


def __getattr__(name: str):  # resolved on first use: `kenlm` (hf-bpd build-ngram's parser) needs no torch
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
