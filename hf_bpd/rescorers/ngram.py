"""Global n-gram rescoring (paper Sec. 7.2): the exact p-best lattice rescorer over a KenLM model of token ids.

`NgramRescorer` returns the p best paths through a step's top-k lattice under

    score(path) = sum_i logprob_i(r_i) + alpha_i * ln(10) * log10 P_ngram(token_i(r_i) | history),

where the history starts with the last `order - 1` tokens of the context. The search is an exact dynamic program
over heads: paths that reach the same KenLM state (KenLM states are minimal: they keep only the words a longer
n-gram can use) have identical futures, so keeping the p best per state is enough. It runs in a small compiled
library (`csrc/ngram_pbest.cpp`, built by `install.sh` against KenLM; see `hf_bpd.rescorers.kenlm`) or, when that
is absent, in pure Python with the same arithmetic and tie-breaking (score, then rank vector), so both return the
same drafts. Models are built with `hf_bpd.build_ngram` (`hf-bpd build-ngram`).
"""

from __future__ import annotations

import ctypes
import math
import warnings
from pathlib import Path

import torch

from ..errors import BPDConfigError
from ..lattice import Draft, Lattice
from .base import Rescorer, register_rescorer
from .kenlm import BUILD_HINT, SETUP_HINT, KenLMNotFoundError, NgramError, _load_python_model, _one_line, load_fast_path
from . import kenlm as _kenlm

LN10 = math.log(10.0)
_warned_python = False


# ----------------------------------------------------------------------------------------------------------------
# The p-best search


def _path_order(path: tuple[float, tuple[int, ...]]):
    """Sort key of a `(score, ranks)` path: higher score first, then the smaller rank vector."""
    return -path[0], path[1]


def pbest_python(model, context: list[int], tokens: list[list[int]], logprobs: list[list[float]],
                 weights: list[float], p: int, order: int) -> list[tuple[tuple[int, ...], float]]:
    """Exact p-best paths in pure Python (the reference for the compiled path; same result, slower).

    Args:
        model: a `kenlm.Model`.
        context: the history, at most `order - 1` token ids.
        tokens, logprobs: `(num_heads, k)` lattice token ids and head log-probabilities.
        weights: `(num_heads,)` n-gram weight per head, already multiplied by ln(10).
        p: paths to return.
        order: n-gram order to use (<= the model's); histories are cut to `order - 1` tokens.
    Returns:
        Up to `p` `(ranks, score)`, best first; `ranks[i]` indexes `tokens[i]`.
    """
    import kenlm

    keep = order - 1
    cut = keep < model.order - 1  # using a lower order: rebuild each state from its last `keep` tokens
    states: dict[tuple[int, ...], kenlm.State] = {}

    def state_of(tail: tuple[int, ...]):
        if tail not in states:
            state = kenlm.State()
            model.NullContextWrite(state)
            for token in tail:
                following = kenlm.State()
                model.BaseScore(state, str(token), following)
                state = following
            states[tail] = state
        return states[tail]

    start = tuple(context[-keep:]) if keep else ()
    layer = {state_of(start): (start, [(0.0, ())])}  # KenLM state -> (a token tail, its p best paths)
    for i, (row, row_lp) in enumerate(zip(tokens, logprobs)):
        last = i == len(tokens) - 1
        words = [str(t) for t in row]
        following_layer: dict = {}
        for state, (tail, paths) in layer.items():
            for r, word in enumerate(words):
                following = kenlm.State()
                term = row_lp[r] + weights[i] * model.BaseScore(state, word, following)
                following_tail = None
                if cut:
                    following_tail = (tail + (row[r],))[-keep:] if keep else ()
                    following = state_of(following_tail)
                key = None if last else following  # the last head has no future: one bucket
                _, bucket = following_layer.setdefault(key, (following_tail, []))
                bucket.extend((score + term, ranks + (r,)) for score, ranks in paths)
        layer = {state: (tail, sorted(bucket, key=_path_order)[:p])
                 for state, (tail, bucket) in following_layer.items()}
    (_, best), = layer.values()
    return [(ranks, score) for score, ranks in best]


def pbest_compiled(handle, context: list[int], tokens: torch.Tensor, logprobs: torch.Tensor, weights: list[float],
                   p: int, order: int) -> list[tuple[tuple[int, ...], float]]:
    """`pbest_python` in the compiled library; `handle` from its `bpd_ngram_load`, lattice tensors `(h, k)`."""
    lib = load_fast_path()
    h, k = tokens.shape
    history = torch.tensor(context, dtype=torch.int64)
    tokens = tokens.to(torch.int64).contiguous()
    logprobs = logprobs.to(torch.float64).contiguous()
    weights = torch.tensor(weights, dtype=torch.float64)
    ranks = torch.empty((p, h), dtype=torch.int32)
    scores = torch.empty(p, dtype=torch.float64)
    error = ctypes.create_string_buffer(512)
    n = lib.bpd_ngram_pbest(handle, history.data_ptr(), len(context), tokens.data_ptr(), logprobs.data_ptr(),
                            weights.data_ptr(), h, k, p, order, ranks.data_ptr(), scores.data_ptr(), error, 512)
    if n < 0:
        raise NgramError(f"n-gram rescoring failed: {error.value.decode(errors='replace')}")
    return list(zip(map(tuple, ranks[:n].tolist()), scores[:n].tolist()))


@register_rescorer("ngram")
class NgramRescorer(Rescorer):
    """Global n-gram rescoring: the `num_drafts` best lattice paths under heads + alpha * n-gram (exact).

    Args:
        path: a KenLM model over token ids (binary from `build_ngram`, or ARPA).
        alpha: interpolation weight α >= 0 of the n-gram log-probability (0: head scores alone).
        order: use at most this n-gram order (histories of `order - 1` tokens); default the model's.
        entropy_adaptive: weight the n-gram more on uncertain heads (paper App. B.2, future work): head `i` gets
            `alpha_i = alpha * H_i / mean_j H_j`, with `H_i` the entropy (nats) of head `i`'s top-k probabilities
            renormalised to sum to 1 (the lattice keeps only the top k); `alpha_i = alpha` if every `H_i` is 0.
        backend: `"auto"` (compiled if built, else Python with a one-time warning), `"compiled"` or `"python"`.
    """

    def __init__(self, path, alpha: float = 1.0, order: int | None = None, entropy_adaptive: bool = False,
                 backend: str = "auto"):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
            raise BPDConfigError(f"alpha (the n-gram interpolation weight) must be a finite number >= 0, got {alpha!r}")
        if backend not in ("auto", "compiled", "python"):
            raise BPDConfigError(f"backend must be 'auto', 'compiled' or 'python', got {backend!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise NgramError(f"no n-gram model at {self.path}: {BUILD_HINT}")
        self.alpha = float(alpha)
        self.entropy_adaptive = bool(entropy_adaptive)
        self._handle = self._model = None
        lib = load_fast_path() if backend != "python" else None
        if lib is not None:
            error = ctypes.create_string_buffer(512)
            self._handle = lib.bpd_ngram_load(str(self.path).encode(), error, 512)
            if not self._handle:
                raise NgramError(f"{self.path} is not a KenLM model ({_one_line(error.value.decode(errors='replace'))})"
                                 f": {BUILD_HINT}")
            self.model_order = lib.bpd_ngram_order(self._handle)
            self.backend = "compiled"
        elif backend == "compiled":
            raise KenLMNotFoundError(f"the compiled n-gram rescorer is not built: {SETUP_HINT}")
        else:
            self._model = _load_python_model(self.path)
            self.model_order = self._model.order
            self.backend = "python"
            global _warned_python
            if backend == "auto" and not _warned_python:
                _warned_python = True
                warnings.warn(f"hf_bpd's compiled n-gram rescorer is not built, using the slower pure-Python one: "
                              f"{SETUP_HINT}", stacklevel=2)
        if order is None:
            order = self.model_order
        if isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= self.model_order:
            raise BPDConfigError(f"order must be an integer in [1, {self.model_order}] (the model's order), "
                                 f"got {order!r}")
        self.order = order

    @classmethod
    def from_bundle(cls, base_model, path, alpha: float = 1.0, order: int | None = None, **fields) -> "NgramRescorer":
        """A bundled n-gram: `rescorers/<file>` of a checkpoint, with its tuned `alpha` and `order`."""
        return cls(path, alpha=alpha, order=order)

    def __del__(self):
        if getattr(self, "_handle", None) and _kenlm._library is not None:
            _kenlm._library.bpd_ngram_free(self._handle)
            self._handle = None

    def __reduce__(self):  # pickles as its arguments: the KenLM model is loaded again
        return NgramRescorer, (self.path, self.alpha, self.order, self.entropy_adaptive, self.backend)

    def __repr__(self) -> str:
        return (f"NgramRescorer({str(self.path)!r}, alpha={self.alpha}, order={self.order}, "
                f"entropy_adaptive={self.entropy_adaptive}, backend={self.backend!r})")

    def head_weights(self, lattice: Lattice) -> list[float]:
        """`(num_heads,)` weights of the n-gram log10-probability per head: `alpha_i * ln(10)`."""
        h = lattice.num_heads
        if not self.entropy_adaptive:
            return [self.alpha * LN10] * h
        entropy = torch.special.entr(torch.softmax(lattice.logprobs.double(), dim=-1)).sum(-1)
        mean = float(entropy.mean())
        if mean <= 0.0:
            return [self.alpha * LN10] * h
        return (self.alpha * LN10 * entropy / mean).tolist()

    def rescore(self, lattice: Lattice, context: list[int], num_drafts: int) -> list[Draft]:
        """The `num_drafts` best paths of `lattice` `(num_heads, k)` after `context`, best first (see the class)."""
        if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or num_drafts < 1:
            raise BPDConfigError(f"num_drafts must be an integer >= 1, got {num_drafts!r}")
        h, k = lattice.tokens.shape
        if h == 0 or k == 0:
            return []
        num_drafts = min(num_drafts, k**h)  # no more paths than the lattice has
        keep = self.order - 1
        history = [int(t) for t in context[max(len(context) - keep, 0):]]
        weights = self.head_weights(lattice)
        if self._handle is not None:
            best = pbest_compiled(self._handle, history, lattice.tokens, lattice.logprobs, weights, num_drafts,
                                  self.order)
        else:
            best = pbest_python(self._model, history, lattice.tokens.tolist(), lattice.logprobs.double().tolist(),
                                weights, num_drafts, self.order)
        rows = lattice.tokens.tolist()
        return [Draft(tuple(rows[i][r] for i, r in enumerate(ranks)), score) for ranks, score in best]

