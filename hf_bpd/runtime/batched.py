"""Compiled verification for batches (`generate(..., compile="wait")` on several prompts): the verification step of
`hf_bpd.runtime.step` over a static cache of `rows` rows, one graph per (rows, block width), compiled in the call.

The batch's rows accept different numbers of tokens per step, so their caches do not stay aligned. On the static
cache every row writes its block at the same slots (one write offset for the batch, the cache's `cumulative_length`)
and masks out what it did not keep (`hf_bpd.generation.batch_cache`). The step's inputs are `(rows, W)` tokens and
positions and a `(rows, 1, W, max_cache_len)` additive mask over the whole cache, so a shape is its `(rows, W)`.

Why it pays (SmolLM2-135M fp32, AMD EPYC AVX-512, 2 threads, 512 slots): a step of 16 rows x 1 token took 60 ms
compiled against ~110 ms eagerly. Attention reads only the slots in use (`hf_bpd::used_slots_attention`, see
`hf_bpd.runtime.attention`): over all 512 it was ~45 % of the 16-row step. With it, 32 dev prompts x 96 tokens in
batches of 16 decode at 247 tok/s compiled (191 reading every slot) against 119 for transformers' batched
`generate()`. Each shape compiles in ~65-95 s, so a call compiles only the shapes it meets (`compile="wait"`), and
the graphs are kept for every later call of the process; `compile=True` (which never blocks for minutes) verifies
batches eagerly.
Each compiled graph holds its own packed copy of the weights (inductor's freezing), so a base's batched shapes share
`MAX_GRAPH_BYTES` of them; once that is spent, a new shape runs the same step eagerly on the same cache.

Half-precision bases are not served (their batched rows do not round as a lone sequence's anyway; they verify
eagerly), nor caches over `MAX_CACHE_BYTES` (long prompts in a wide batch).
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

import torch
from transformers.cache_utils import StaticCache

from .attention import BATCHED_ATTENTION_NAME, grouped_query_attention, uses_grouped_attention
from .compiled import CACHE_BUCKET, MAX_COMPILED_SHAPES, _Patches
from .cost import weight_bytes
from .guards import call_compiled, compile_step
from .step import VerificationStep, compile_unsupported_reason, kv_layout, verification_cache

MAX_CACHE_BYTES = 2 << 30  # the static caches of a base's batched runners, together (a batch past it: eager)
MAX_GRAPH_BYTES = 4 << 30  # the packed weights of a base's compiled batched shapes (beyond: eager steps, same cache)
TIMED_CALLS = 3  # calls timed after a shape compiles (their median: `width_ms`)


def max_graphs(base) -> int:
    """How many batched shapes one base may compile: each frozen graph holds its own packed copy of the weights
    (SmolLM2 fp32: ~540 MB), so they share `MAX_GRAPH_BYTES` (at least 2: a plain and a drafted width)."""
    return max(2, MAX_GRAPH_BYTES // max(weight_bytes(base), 1))


def compiled_graphs(base) -> int:
    """The batched shapes `base` has compiled in this process."""
    return sum(len(runner.compiled_widths) for runner in _RUNNERS.get(base, {}).values())


def batched_unsupported_reason(base) -> str | None:
    """Why batches of `base` cannot run the compiled step (None when they can)."""
    reason = compile_unsupported_reason(base)
    if reason is not None:
        return reason
    if base.dtype not in (torch.float32, torch.float64):
        return "half-precision batches verify eagerly"
    return None


def cache_bytes(base, rows: int, max_cache_len: int) -> int:
    """Bytes of the static keys and values of `rows` rows x `max_cache_len` slots."""
    kv_heads, head_dim = kv_layout(base.config)
    layers = base.config.get_text_config(decoder=True).num_hidden_layers
    per_slot = 2 * layers * kv_heads * head_dim * base.dtype.itemsize
    return rows * max_cache_len * per_slot


class BatchedRunner:
    """One base's static cache of `rows` rows and its compiled steps, one graph per block width, shared by every
    call (see the module docstring)."""

    def __init__(self, base, rows: int, max_cache_len: int):
        self.base, self.rows, self.max_cache_len = base, rows, max_cache_len
        self.cache: StaticCache = verification_cache(base.config, max_cache_len)
        self.step = VerificationStep(base, self.cache).eval()
        self.grouped = uses_grouped_attention(base)
        self._compiled = None
        self.failed = False  # compiling failed once: every step of this runner runs eagerly
        self.graph_limit = max_graphs(base)  # read where a new shape would compile (weights summed once, here)
        self.compiled_widths: dict[int, float] = {}  # width -> seconds its first call took (compilation)
        self.width_ms: dict[int, float] = {}  # width -> ms of the step, timed after compiling
        with torch.no_grad(), grouped_query_attention(base, self.grouped):  # allocate the cache now, eagerly
            one = torch.zeros(rows, 1, dtype=torch.long, device=base.device)
            mask = torch.zeros(rows, 1, 1, max_cache_len, dtype=base.dtype, device=base.device)
            self.step(one, one, one[0], mask)
        self.set_length(0)

    @property
    def layers(self):
        return self.cache.layers

    def set_length(self, length: int) -> None:
        """Where the next block is written (every row at the same slots)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    def run(self, tokens, positions, mask) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One step: `tokens`, `positions` `(rows, W)`, `mask` `(rows, 1, W, max_cache_len)`, written at the current
        length. Returns `(logits (rows, W, vocab), hidden (rows, W, hidden_size), compiled)`: whether this call
        compiled the shape (its time is compilation, not a step)."""
        width = tokens.shape[1]
        past = int(self.cache.layers[0].cumulative_length)
        slots = torch.arange(past, past + width, device=tokens.device)
        if self._compiled is None:
            self._compiled = compile_step(self.step)
        with grouped_query_attention(self.base, self.grouped, BATCHED_ATTENTION_NAME):
            done = call_compiled(self._compiled, tokens, positions, slots, mask) \
                if width in self.compiled_widths else None
            if done is not None:
                return *done, False
            if self.failed or compiled_graphs(self.base) >= self.graph_limit:  # the memory bound, or no compiler
                logits, hidden = self.step(tokens, positions, slots, mask)
                return logits, hidden, False
            start = time.perf_counter()
            try:
                with _Patches():
                    logits, hidden = self._compiled(tokens, positions, slots, mask)
            except Exception as err:  # noqa: BLE001 - a failing compiler must not break generation
                warnings.warn(f"hf_bpd: compiling the batched step failed ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''}); its steps run eagerly",
                              stacklevel=2)
                self.failed = True
                self.set_length(past)
                logits, hidden = self.step(tokens, positions, slots, mask)
                return logits, hidden, False
            times = []
            for _ in range(TIMED_CALLS):  # the step's own cost, for the batch's width choice (writes where it wrote)
                self.set_length(past)
                begin = time.perf_counter()
                logits, hidden = self._compiled(tokens, positions, slots, mask)
                times.append(1000 * (time.perf_counter() - begin))
            self.width_ms[width] = sorted(times)[len(times) // 2]
            self.compiled_widths[width] = time.perf_counter() - start  # compiling and timing: not a step's time
        return logits, hidden, True


# base model -> {(rows, max_cache_len): runner}
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()  # one compiled batch at a time (a call may move between runners as its rows finish)


def batched_lock() -> threading.RLock:
    """Held by a batch while it runs on compiled runners."""
    return _LOCK


def batched_runner(base, rows: int, needed_length: int) -> BatchedRunner | None:
    """The runner of `base` for `rows` rows whose cache holds `needed_length` tokens (the smallest existing one,
    else a new one rounded up to `CACHE_BUCKET` slots); None when the base's runners' caches would then pass
    `MAX_CACHE_BYTES` together (runners are kept for the process)."""
    runners = _RUNNERS.setdefault(base, {})
    fitting = [size for r, size in runners if r == rows and size >= needed_length]
    if fitting:
        return runners[rows, min(fitting)]
    size = -(-needed_length // CACHE_BUCKET) * CACHE_BUCKET
    held = sum(cache_bytes(base, r, n) for r, n in runners)  # the static caches this base's runners keep
    if held + cache_bytes(base, rows, size) > MAX_CACHE_BYTES or len(runners) >= MAX_COMPILED_SHAPES:
        return None
    runner = runners[rows, size] = BatchedRunner(base, rows, size)
    return runner


def discard_batched_runners(base) -> None:
    """Forget `base`'s batched runners (after a failed compile: the next call starts afresh)."""
    _RUNNERS.pop(base, None)
