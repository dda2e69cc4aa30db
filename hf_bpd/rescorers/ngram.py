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
import json
import math
import warnings
from pathlib import Path

import torch

from ..errors import BPDConfigError, WorkLimitError
from ..limits import PYTHON_NGRAM_MAX_TOP_K, PYTHON_NGRAM_MAX_WORK
from ..lattice import Draft, Lattice
from .base import Rescorer, register_rescorer
from .kenlm import (BUILD_HINT, SETUP_HINT, KenLMNotFoundError, NgramError, _load_python_model, _one_line, file_sha256,
                    info_path, load_fast_path)
from . import kenlm as _kenlm

LN10 = math.log(10.0)
_warned_python = False
# The pure-Python search (used when the compiled one is not built) is far slower: its own ceilings (hf_bpd.limits).
PYTHON_MAX_WORK = PYTHON_NGRAM_MAX_WORK
PYTHON_MAX_TOP_K = PYTHON_NGRAM_MAX_TOP_K
VOCAB_PADDING = 512  # a base's embedding rows may exceed its tokenizer's size by less than this


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

    parses_natively = True  # KenLM's C++ reads the file, whichever backend

    def __init__(self, path, alpha: float = 1.0, order: int | None = None, entropy_adaptive: bool = False,
                 backend: str = "auto", sha256: str | None = None):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
            raise BPDConfigError(f"alpha (the n-gram interpolation weight) must be a finite number >= 0, got {alpha!r}")
        if backend not in ("auto", "compiled", "python"):
            raise BPDConfigError(f"backend must be 'auto', 'compiled' or 'python', got {backend!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise NgramError(f"no n-gram model at {self.path}: {BUILD_HINT}")
        self.info = _read_info(self.path)
        # A truncated or garbled KenLM file can crash KenLM itself (measured: a segmentation fault in the pure-Python
        # path), so a file whose digest was recorded (by build_ngram, or in a checkpoint's config.json) is checked
        # before KenLM reads it.
        expected = sha256 or self.info.get("sha256")
        if expected:
            actual = file_sha256(self.path)
            if actual != expected:
                source = "the checkpoint's config.json" if sha256 else info_path(self.path).name
                raise NgramError(f"{self.path} is corrupt or was replaced: its sha256 {actual[:16]}... differs from "
                                 f"{expected[:16]}... recorded in {source}: restore the file or rebuild it "
                                 "(hf-bpd build-ngram)")
        self.sha256 = expected
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
    def from_bundle(cls, base_model, path, alpha: float = 1.0, order: int | None = None, sha256: str | None = None,
                    vocab_size: int | None = None, **fields) -> "NgramRescorer":
        """A bundled n-gram: `rescorers/<file>` of a checkpoint, with its tuned `alpha` and `order` (and, when
        recorded, the file's `sha256` and the `vocab_size` of the tokenizer it was built with, both checked)."""
        rescorer = cls(path, alpha=alpha, order=order, sha256=sha256)
        if vocab_size is not None:
            rescorer.info.setdefault("vocab_size", vocab_size)
        rescorer.check_vocabulary(base_model.config.get_text_config().vocab_size)
        return rescorer

    def check_vocabulary(self, base_vocab: int) -> None:
        """Raise `NgramError` when this n-gram was built with a tokenizer of another size than the base's."""
        built = self.info.get("vocab_size")
        # an embedding may be padded beyond its tokenizer (Qwen2.5: 151,665 tokens, 151,936 rows)
        if built is not None and not 0 <= int(base_vocab) - int(built) < VOCAB_PADDING:
            raise NgramError(f"{self.path} was built over a {built}-token tokenizer but the base model has "
                             f"{base_vocab} tokens: build the n-gram with this base's tokenizer "
                             "(hf-bpd build-ngram --model BASE)")

    def check_compatible(self, model) -> None:
        self.check_vocabulary(model.config.get_text_config().vocab_size)

    def work_ceiling(self) -> int:
        return self.max_work if self.backend == "compiled" else PYTHON_MAX_WORK

    def work_note(self) -> str:
        return "" if self.backend == "compiled" else (f" (the pure-Python n-gram search; the compiled one allows "
                                                      f"{self.max_work}: {SETUP_HINT})")

    def check_work(self, num_heads: int, top_k: int, num_drafts: int) -> None:
        if self.backend != "compiled" and top_k > PYTHON_MAX_TOP_K:
            raise WorkLimitError(f"draft_top_k={top_k} is over the pure-Python n-gram search's ceiling of "
                                 f"{PYTHON_MAX_TOP_K}: lower draft_top_k, or build the compiled search ({SETUP_HINT})")
        super().check_work(num_heads, top_k, num_drafts)

    def __del__(self):
        try:
            if getattr(self, "_handle", None) and _kenlm._library is not None:
                _kenlm._library.bpd_ngram_free(self._handle)
                self._handle = None
        except Exception:  # noqa: BLE001 - at interpreter exit the module may already be torn down
            pass

    def __reduce__(self):  # pickles as its arguments: the KenLM model is loaded again
        return NgramRescorer, (self.path, self.alpha, self.order, self.entropy_adaptive, self.backend, self.sha256)

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
        self.check_work(h, k, num_drafts)  # bounded time and memory, whoever calls (generate checks up front)
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



def _read_info(path: Path) -> dict:
    """The JSON `build_ngram` writes beside a model (order, counts, sha256, vocab_size), or {} if absent."""
    info = info_path(path)
    if not info.is_file():
        return {}
    try:
        data = json.loads(info.read_text())
    except (ValueError, OSError) as err:
        raise NgramError(f"{info} is not valid JSON ({_one_line(err)}): delete it or rebuild the n-gram") from None
    if not isinstance(data, dict):
        raise NgramError(f"{info} must hold a JSON object: delete it or rebuild the n-gram")
    return data
