"""Draft refinement (paper Sec. 7): rescorers pick drafts from the heads' top-k lattice.

`base` holds the `Rescorer` interface and the registry (`register_rescorer`, `available_rescorers`); `ngram` the
exact p-best n-gram rescorer (KenLM; `kenlm` installs, builds and compiles its fast path); `neural` the local
neural rescorer (Alg. 2). Adding a rescorer is one module with one `@register_rescorer("name")` class.
"""

from .base import (NO_RESCORER, HeadScoreRescorer, Rescorer, available_rescorers, register_rescorer,
                   rescorer_class, resolve_rescorer)
from .kenlm import build_ngram
from .neural import NeuralRescorer
from .ngram import NgramRescorer

__all__ = ["NO_RESCORER", "HeadScoreRescorer", "NeuralRescorer", "NgramRescorer", "Rescorer",
           "available_rescorers", "build_ngram", "register_rescorer", "rescorer_class", "resolve_rescorer"]
