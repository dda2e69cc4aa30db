"""Compiled verification for batches (`generate(..., compile="wait")` on several prompts): the verification step of
`hf_bpd.runtime.step` over a static cache of `rows` rows, one graph per (rows, block width), compiled in the call.

The batch's rows accept different numbers of tokens per step, so their caches do not stay aligned. On the static
cache every row writes its block at the same slots (one write offset for the batch, the cache's `cumulative_length`)
and masks out what it did not keep (`hf_bpd.generation.batch_cache`). The step's inputs are `(rows, W)` tokens and
positions and a `(rows, 1, W, max_cache_len)` additive mask over the whole cache, so a shape is its `(rows, W)`.

Why it pays: a compiled batch step costs far less than the eager one, and its attention reads only the slots in use
(`hf_bpd::used_slots_attention`, see `hf_bpd.runtime.attention`), since reading the whole static cache is a large
share of a wide step (docs/performance.md, "Batches"). Each shape takes a minute or more to compile, so a call
compiles only the shapes it meets (`compile="wait"`), and the graphs are kept for every later call of the process.
`compile=True` (which never blocks for minutes) verifies fp32 batches on the base's artifact instead
(`ArtifactBatchedRunner`, `hf_bpd.runtime.artifacts`: the same step, exported once per machine with dynamic rows,
block length and context, loaded in seconds; eagerly while it is being built in the background): no shape compiles in
any call. Its one-token steps run the artifact's one-token batch step (`hf_bpd.runtime.artifacts.ONE_TOKEN`, built
when a batch first needs it), no slower than the compiled shape (docs/performance.md, "Batches").
Each compiled graph holds its own packed copy of the weights (inductor's freezing), so a base's batched shapes share
`MAX_GRAPH_BYTES` of them; once that is spent, a new shape runs the same step eagerly on the same cache.

bf16 and int8-weight bases where hf_bpd's kernels run (`hf_bpd.runtime.packed_linear`) step on the packed module
tree with position-ordered attention (`hf_bpd.runtime.ordered_attention`), each sequence of the batch over its own
positions (`key_slots (rows, W, max_cache_len)`: row r's query i reads position p from slot `key_slots[r, i, p]`,
its kept slots in order, holes skipped): every row of every step rounds as the same sequence's lone compiled step,
so a batch's rows are the lone sequences' compiled outputs (their prompts run alone,
`hf_bpd.generation.batch_cache.StaticRaggedCache.prefilled`). Other half-precision bases verify eagerly, as do
caches over `MAX_CACHE_BYTES` (long prompts in a wide batch).
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

import torch
from transformers.cache_utils import StaticCache

from . import weights
from .attention import (ATTENTION_NAME, BATCHED_ATTENTION_NAME, attention_implementation, grouped_query_attention,
                        uses_grouped_attention)
from .compiled import CACHE_BUCKET, MAX_COMPILED_SHAPES, _Patches
from .cache_files import KeptCosts
from .cost import weight_bytes
from .guards import call_compiled, compile_step
from .ordered_attention import ORDERED_KERNEL_ATTENTION, uses_ordered_attention
from .packed_linear import packed_base
from .step import VerificationStep, compile_unsupported_reason, has_sliding_layers, kv_layout, verification_cache

MAX_CACHE_BYTES = 2 << 30  # the static caches of a base's batched runners, together (a batch past it: eager)
MAX_GRAPH_BYTES = 4 << 30  # the packed weights of a base's compiled batched shapes (beyond: eager steps, same cache)
TIMED_CALLS = 3  # calls timed after a shape compiles (their median: `width_ms`)
COST_CALLS = 3  # calls timed per block shape for an artifact runner's cost table (`measured_costs`)


def max_graphs(base) -> int:
    """How many batched shapes one base may compile: each frozen graph holds its own packed copy of the weights
    (inductor's freezing), so they share `MAX_GRAPH_BYTES` (at least 2: a plain and a drafted width)."""
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
        if not ordered_base(base):
            return "half-precision batches verify eagerly (compiled batches: fp32, or bf16 on hf_bpd's kernels)"
        if has_sliding_layers(base.config):
            return "bf16 batches of sliding-window bases verify eagerly"
        if kv_layout(base.config)[1] % 16 or packed_base(base) is None:
            return "bf16 batches verify eagerly where hf_bpd's kernels do not run (AVX512-BF16 or AVX2, head dim % 16)"
    return None


def ordered_base(base) -> bool:
    """Whether `base`'s batched steps run on hf_bpd's kernels with position-ordered attention (bf16 bases)."""
    return base.dtype == torch.bfloat16 and uses_ordered_attention(base)


def cache_bytes(base, rows: int, max_cache_len: int) -> int:
    """Bytes of the static keys and values of `rows` rows x `max_cache_len` slots."""
    kv_heads, head_dim = kv_layout(base.config)
    layers = base.config.get_text_config(decoder=True).num_hidden_layers
    per_slot = 2 * layers * kv_heads * head_dim * base.dtype.itemsize
    return rows * max_cache_len * per_slot


class BatchedRunner:
    """One base's static cache of `rows` rows and its compiled steps, one graph per block width, shared by every
    call (see the module docstring)."""

    kind = "compiled"  # what `GenerationStats.verifier` reports (and the runner's key in `_RUNNERS`)
    artifact = None  # the prebuilt step an `ArtifactBatchedRunner` runs
    dynamic_rows = False  # whether a step may compute fewer rows than the cache holds (its first ones)

    def __init__(self, base, rows: int, max_cache_len: int):
        self.base, self.rows, self.max_cache_len = base, rows, max_cache_len
        self.cache: StaticCache = verification_cache(base.config, max_cache_len)
        self.ordered = ordered_base(base)  # bf16: the packed module tree, each row over its own positions
        self.step = VerificationStep(packed_base(base) if self.ordered else base, self.cache).eval()
        self.grouped = uses_grouped_attention(base)
        self._compiled = None
        self.failed = False  # compiling failed once: every step of this runner runs eagerly
        self.graph_limit = max_graphs(base)  # read where a new shape would compile (weights summed once, here)
        self.compiled_widths: dict[int, float] = {}  # width -> seconds its first call took (compilation)
        self.width_ms: dict[int, float] = {}  # width -> ms of the step, timed after compiling
        with torch.no_grad(), self.attention():  # allocate the cache now, eagerly
            one = torch.zeros(rows, 1, dtype=torch.long, device=base.device)
            mask = torch.zeros(rows, 1, 1, max_cache_len, dtype=base.dtype, device=base.device)
            self.step(one, one, one[0], mask, *self.key_order(rows, 1, base.device))
        self.set_length(0)

    def attention(self, batched: bool = False):
        """The steps' attention: position-ordered (bf16), else PyTorch's grouped kernel, or in a step
        (`batched`) the attention over the slots in use."""
        if self.ordered:
            return attention_implementation(self.base, ORDERED_KERNEL_ATTENTION)
        return grouped_query_attention(self.base, self.grouped, BATCHED_ATTENTION_NAME if batched else ATTENTION_NAME)

    def key_order(self, rows: int, width: int, device) -> tuple:
        """`(key_slots, key_ranks)` that read every slot at its own position (ordered steps), else nothing."""
        if not self.ordered:
            return ()
        return torch.arange(self.max_cache_len, device=device).expand(rows, width, -1).contiguous(), None

    @property
    def layers(self):
        return self.cache.layers

    def set_length(self, length: int) -> None:
        """Where the next block is written (every row at the same slots)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    def run(self, tokens, positions, mask, key_slots=None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One step: `tokens`, `positions` `(rows, W)`, `mask` `(rows, 1, W, max_cache_len)`, written at the current
        length; ordered steps: `mask` by position and `key_slots (rows, W, max_cache_len)` (see the module docstring).
        Returns `(logits (rows, W, vocab), hidden (rows, W, hidden_size), compiled)`: whether this call compiled the
        shape (its time is compilation, not a step)."""
        width = tokens.shape[1]
        past = int(self.cache.layers[0].cumulative_length)
        slots = torch.arange(past, past + width, device=tokens.device)
        inputs = (tokens, positions, slots, mask) + ((key_slots, None) if self.ordered else ())
        if self._compiled is None:
            self._compiled = compile_step(self.step)
        with self.attention(batched=True):
            done = call_compiled(self._compiled, *inputs) if width in self.compiled_widths else None
            if done is not None:
                return *done, False
            if self.failed or compiled_graphs(self.base) >= self.graph_limit:  # the memory bound, or no compiler
                logits, hidden = self.step(*inputs)
                return logits, hidden, False
            start = time.perf_counter()
            try:
                with _Patches(self.ordered):
                    logits, hidden = self._compiled(*inputs)
            except Exception as err:  # noqa: BLE001 - a failing compiler must not break generation
                warnings.warn(f"hf_bpd: compiling the batched step failed ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''}); its steps run eagerly",
                              stacklevel=2)
                self.failed = True
                self.set_length(past)
                logits, hidden = self.step(*inputs)
                return logits, hidden, False
            times = []
            for _ in range(TIMED_CALLS):  # the step's own cost, for the batch's width choice (writes where it wrote)
                self.set_length(past)
                begin = time.perf_counter()
                logits, hidden = self._compiled(*inputs)
                times.append(1000 * (time.perf_counter() - begin))
            self.width_ms[width] = sorted(times)[len(times) // 2]
            self.compiled_widths[width] = time.perf_counter() - start  # compiling and timing: not a step's time
        return logits, hidden, True


class ArtifactBatchedRunner(BatchedRunner):
    """A `BatchedRunner` whose step is the base's prebuilt artifact (`hf_bpd.runtime.artifacts`: dynamic rows, block
    length and context), loaded, never compiled: what `compile=True` verifies a batch with. Each step attends the
    slots up to its block only and computes the cache's first rows, as many as it is given (the batch's active rows:
    `hf_bpd.generation.batch_cache.StaticRaggedCache`); a block over the artifact's `MAX_BLOCK` runs the same step
    eagerly on the same cache, every row. Steps of one token per row run the artifact's one-token batch step once it
    is built (`one_token`; `hf_bpd.runtime.artifacts.ONE_TOKEN`), and steps of two tokens per row its two-token
    batch step (`two_tokens`, `artifacts.TWO_TOKENS`)."""

    kind = "artifact"
    dynamic_rows = True  # blocks up to `max_block`: the artifact runs any number of the cache's first rows

    def __init__(self, base, rows: int, max_cache_len: int, artifact):
        from .artifacts import MAX_BLOCK

        super().__init__(base, rows, max_cache_len)
        self.artifact, self.max_block = artifact, MAX_BLOCK
        self.one_token = None  # the artifact's one-token batch step, once it is built (set by each call)
        self.two_tokens = None  # its two-token batch step, likewise
        self.kv = [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        # `{tokens: ms}` of this runner's steps (`measured_costs`), kept per graphs its steps run on (`_cost_entry`)
        self.kept = KeptCosts(None, "")

    def run(self, tokens, positions, mask, key_slots=None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        width = tokens.shape[1]
        past = int(self.cache.layers[0].cumulative_length)
        if width > self.max_block:
            slots = torch.arange(past, past + width, device=tokens.device)
            with self.attention(batched=True):
                logits, hidden = self.step(tokens, positions, slots, mask)
            return logits, hidden, False
        # the slots in use and this block (a sliding-window base: both layer types' masks)
        attended = ({kind: m[..., : past + width].contiguous() for kind, m in mask.items()} if isinstance(mask, dict)
                    else mask[..., : past + width].contiguous())
        rows = tokens.shape[0]  # the cache's first rows (a row-slice of a contiguous tensor is dense)
        kv = self.kv if rows == self.rows else [t[:rows] for t in self.kv]
        step = {1: self.one_token, 2: self.two_tokens}.get(width) or self.artifact
        start = time.perf_counter()
        # dense inputs: the artifact's code indexes rows by the strides it was built with
        logits, hidden = step(tokens.contiguous(), positions.contiguous(), attended, torch.tensor(past), kv)
        # a kept cost is checked against steps shaped as it was timed (every row, or one token on fewer rows)
        if (rows * width in self.kept and (width == 1 or rows == self.rows)
                and self.kept.entry == self._cost_entry()):
            self._check_kept(rows * width, 1000 * (time.perf_counter() - start))
        return logits, hidden, False

    def _check_kept(self, tokens: int, ms: float) -> None:
        """A step over `tokens` tokens took `ms`: checked against its kept cost; a kept table its steps contradict
        (timed on a loaded machine, say) is dropped (`KeptCosts.contradicted`), and the next call's `measured_costs`
        times the steps again."""
        self.kept.contradicted(tokens, ms)

    def measured_costs(self, max_width: int) -> dict[int, float]:
        """`{tokens: ms}` of this runner's own steps, for the batch's width choice: blocks of 1 to `max_width` tokens
        on every row, and one token on fewer rows (halved down to 1: rows leave as they finish), each the median of
        `COST_CALLS` calls after one untimed, written past the cache's current length and rolled back. Timed once per
        machine (kept beside the artifact, `KeptCosts`, per row count and batch steps; checked against each
        process's own steps: `_check_kept`); the batch's own steps then correct the table
        (`BatchWidth.timing`). The eager forward's table misjudges these steps: its costs are mostly fixed overhead,
        theirs grow with the tokens, so scaled to a plain step it would price a drafted one well under its cost."""
        entry = self._cost_entry()
        if self.kept.entry != entry:
            self.kept = KeptCosts(self.artifact, entry)
        costs = dict(self.kept.table)
        past = int(self.cache.layers[0].cumulative_length)
        wanted = [(self.rows, w) for w in range(1, max_width + 1)]
        rows = self.rows // 2
        while rows >= 1:
            wanted.append((rows, 1))
            rows //= 2
        if past + max_width > self.max_cache_len:
            return costs
        measured = False
        with torch.no_grad():
            for rows, width in wanted:
                if rows * width in costs:
                    continue
                tokens = torch.zeros(rows, width, dtype=torch.long, device=self.base.device)
                positions = past + torch.arange(width, device=tokens.device).expand(rows, width)
                mask = torch.zeros(rows, 1, width, self.max_cache_len, dtype=self.base.dtype, device=tokens.device)
                times = []
                for _ in range(COST_CALLS + 1):
                    begin = time.perf_counter()
                    self.run(tokens, positions, mask)
                    times.append(1000 * (time.perf_counter() - begin))
                    self.set_length(past)
                costs[rows * width] = sorted(times[1:])[COST_CALLS // 2]
                measured = True
        if measured:
            self.kept.keep(costs)
        return costs

    def _cost_entry(self) -> str:
        """The kept costs' entry of this runner's steps as they run now: its rows and the batch steps built."""
        return (f"{self.rows} rows" + (", one-token batch step" if self.one_token is not None else "")
                + (", two-token batch step" if self.two_tokens is not None else ""))


def batched_artifact_unsupported_reason(base, rows: int) -> str | None:
    """Why `base`'s artifact cannot verify its batches of `rows` rows (None when it can): artifacts off or unable to
    serve the base, position-ordered (bf16) bases, whose batches compile in the call, and more rows than it serves.
    (A sliding-window base's artifact takes both layer types' masks, which a batch builds for its rows.)"""
    from . import artifacts

    if rows > artifacts.MAX_ROWS:
        return f"the artifact serves batches of up to {artifacts.MAX_ROWS} rows"
    if not artifacts.enabled():
        return "artifacts are turned off (HF_BPD_OFF=artifacts)"
    if ordered_base(base):
        return "bf16 batches on hf_bpd's kernels have no artifact"
    return artifacts.unsupported_reason(base)


# base model -> {(rows, max_cache_len, kind): runner}; kind "compiled" (compiled in the call) or "artifact"
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WEIGHTS_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> its weights' marker at the last call
_LOCK = threading.RLock()  # one compiled batch at a time (a call may move between runners as its rows finish)


def batched_lock() -> threading.RLock:
    """Held by a batch while it runs on compiled runners."""
    return _LOCK


def batched_runner(base, rows: int, needed_length: int, artifact=None) -> BatchedRunner | None:
    """The runner of `base` for `rows` rows whose cache holds `needed_length` tokens, running `artifact` (an
    `ArtifactBatchedRunner`) or compiling its shapes (when `artifact` is None): the smallest existing one of that
    kind, else a new one rounded up to `CACHE_BUCKET` slots; None when the base's runners' caches would then pass
    `MAX_CACHE_BYTES` together (runners are kept for the process)."""
    if weights.changed_since(base, _WEIGHTS_SEEN):  # its runners' graphs hold the old weights
        _RUNNERS.pop(base, None)
    runners = _RUNNERS.setdefault(base, {})
    kind = (BatchedRunner if artifact is None else ArtifactBatchedRunner).kind
    for key in [k for k, r in runners.items() if k[2] == "artifact" and r.artifact is not artifact]:
        del runners[key]  # built on another artifact (of this base's earlier weights)
    fitting = [size for r, size, k in runners if r == rows and k == kind and size >= needed_length]
    if fitting:
        return runners[rows, min(fitting), kind]
    size = -(-needed_length // CACHE_BUCKET) * CACHE_BUCKET
    held = sum(cache_bytes(base, r, n) for r, n, _ in runners)  # the static caches this base's runners keep
    if held + cache_bytes(base, rows, size) > MAX_CACHE_BYTES or len(runners) >= MAX_COMPILED_SHAPES:
        return None
    runner = BatchedRunner(base, rows, size) if artifact is None else ArtifactBatchedRunner(base, rows, size, artifact)
    runners[rows, size, kind] = runner
    return runner


def discard_batched_runners(base) -> None:
    """Forget `base`'s batched runners (after a failed compile: the next call starts afresh)."""
    _RUNNERS.pop(base, None)
