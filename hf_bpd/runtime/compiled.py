"""Compiled verification (`generate(..., compile=True)`): a `torch.compile`d step (inductor, `freezing` with
prepacked weights, `max_autotune` CPU GEMM templates; docs/performance.md, "Why the compiled step is fast") on a
`StaticCache` that is created once per base model and reused by every call, so every step has one of a few fixed
shapes: the block is padded to the drafting plan's largest block (the last token plus every node its drafts can have)
and the attention mask is a 4D tensor over the whole static cache (one buffer per call, of which each step rewrites
only the columns that changed). The cache holds the call's `max_length` plus one padded block, so the last step's
padding stays inside it. One graph is compiled per block length, once per process. The prompt pass runs eagerly into
the same static cache. Rejected tokens are rolled back by moving the accepted path's keys/values into place and
resetting each layer's `cumulative_length` (a `StaticCache` writes at that counter, not at `cache_position`). The
verifier that runs these steps for one call is `hf_bpd.runtime.compiled_verifier.CompiledVerifier`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch import nn

from . import weights
from .attention import attention_implementation, grouped_query_attention, uses_grouped_attention
from .cache_files import KeptCosts
from .frame_stack import on_fresh_frame_stack
from .guards import call_compiled, compile_step
from .inlining import INDUCTOR_OPTIONS, ORDERED_OPTIONS, compiler_options
from .int8_heads import int8_heads_step, kernel_file
from .ordered_attention import ORDERED_ATTENTION, ORDERED_KERNEL_ATTENTION, identity_key_order, uses_ordered_attention
from .packed_linear import packed_base
from .prefetch import prefetching_gemm_template
from .quiet import quiet_compilation
from .step import VerificationStep, kv_layout, verification_cache

# Static caches hold a multiple of this many tokens. The attention kernel reads every slot (masked), so a smaller
# cache is a cheaper step; each size compiles its own graphs, so an existing larger one is reused.
CACHE_BUCKET = 512
# A compiled chain with prompt lookup verifies this many draft nodes per step (a block of 8 tokens): on AVX-512
# inductor's CPU GEMM template multiplies 8 rows at a time, so a block of up to 8 tokens costs little more than one
# token's, and a 9th token starts a second row tile (docs/performance.md, "The cost of a block").
COMPILED_DRAFT_SLOTS = 7
MAX_COMPILED_SHAPES = 64  # block lengths one runner may compile (dynamo's own limit is 8)
TIMED_CALLS = 5  # timed calls of each block length in `warm_up` (after two untimed ones)
ONE_ROW = "1 row"  # a lone call's kept costs (their `KeptCosts` entry)
SANE_DROP = 0.1  # a kept table's longer block may time at most this share under a shorter one


class _Patches(contextlib.ExitStack):
    """The compile settings, applied around every call of a compiled step (see `CompiledRunner`): `INDUCTOR_OPTIONS`
    and GCC told to inline the GEMM micro-kernels of every row count (`hf_bpd.runtime.inlining`), without autotune
    tables on stderr (`hf_bpd.runtime.quiet`). dynamo compiles at most `recompile_limit` (default 8) shapes per
    function, then silently runs it eagerly: each block length is one shape, so the limit is raised.
    `ordered` (half precision): GEMMs by inductor's CPU templates only, which `max_autotune` (always on here) picks
    from (autotuned against ATen's, another kernel won for one row than for eight), rounding to bf16 wherever the
    eager program does (`emulate_precision_casts`: else an int8 layer's epilogue stayed fp32 for one row count and not
    another), and inductor's loops serial (`inlining.SERIAL_LOOPS`): a row rounds alike for any row count."""

    def __init__(self, ordered: bool = False):
        super().__init__()
        self.ordered = ordered

    def __enter__(self):
        super().__enter__()
        options = {**INDUCTOR_OPTIONS, **compiler_options()}
        if self.ordered:
            options.update(ORDERED_OPTIONS)
        self.enter_context(inductor_config.patch(options))
        self.enter_context(dynamo_config.patch(recompile_limit=MAX_COMPILED_SHAPES))
        self.enter_context(prefetching_gemm_template())
        self.enter_context(quiet_compilation())
        return self


class _HeadsStep(nn.Module):
    """Every drafting head on one hidden state, down to the top-k lattice: `(log-probabilities, draft-vocabulary
    indices)`, `(num_heads, top_k)` each. Compiled like the verification step (frozen weights, CPU GEMM templates),
    as the eager heads cost several times more per drafting step. The heads run once per step, on one hidden state,
    in a graph of their own: inside the verification graph they would run on every block position, which costs
    more."""

    def __init__(self, heads, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.heads = nn.ModuleList(heads.heads)
        self.sequential = heads.sequential
        self.input_embeddings = heads._input_embeddings[0] if heads.sequential else None
        self.head_projections = None
        if heads.heads[0].projection is not None:
            self.head_projections = nn.ModuleList(head.projection for head in heads.heads)
        with torch.no_grad():  # the draft-vocabulary rows of the tied output layer, selected once
            weight = heads._base_projection_weight().detach()
            bias = heads._base_projection_bias()
        self.register_buffer("projection", weight, persistent=False)
        self.register_buffer("projection_bias", None if bias is None else bias.detach(), persistent=False)
        self.register_buffer("draft_vocab", heads.draft_vocab, persistent=False)
        self.softcap = heads.logit_softcapping

    def project(self, states, index=None):
        if self.head_projections is not None:
            if index is not None:
                return self.head_projections[index](states)
            return torch.cat([proj(state[None]) for proj, state in zip(self.head_projections, states)])
        return nn.functional.linear(states, self.projection, self.projection_bias)

    def forward(self, hidden, token):
        """`hidden (hidden_size,)`, `token ()` the base's next token (read by sequential heads only)."""
        if self.sequential:  # each head reads the previous head's state and argmax token
            state, rows = hidden[None], []
            for index, head in enumerate(self.heads):
                dtype = head.blocks[0].up.weight.dtype
                state = head(state, self.input_embeddings(token.reshape(1)).to(dtype))
                rows.append(self.project(state, index))
                token = rows[-1][0].argmax(-1)
                if self.draft_vocab is not None:
                    token = self.draft_vocab[token]
            logits = torch.cat(rows)
        else:
            states = torch.cat([head(hidden[None]) for head in self.heads])  # (heads, hidden)
            logits = self.project(states)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.float()
        top = logits.topk(self.top_k, dim=-1)
        return top.values - logits.logsumexp(-1, keepdim=True), top.indices


def head_top_k(top_k: int, draft_size: int) -> int:
    """The lattice width the compiled heads step computes for a plan of width `top_k`: 16 or 64 (one graph serves
    every plan up to it), at most the draft vocabulary."""
    return min(16 if top_k <= 16 else 64, draft_size)


class CompiledRunner:
    """One base model's static cache and compiled steps, shared by every call: the verification step (one graph
    per block length, `compiled_buckets`) and, per heads module and lattice width, the heads step
    (`compiled_heads`)."""

    kind = "compiled"  # what `GenerationStats.verifier` reports
    last_kind = "compiled"  # what ran the last step (`GenerationStats.verifier_steps`)

    def __init__(self, base, max_cache_len: int):
        self.base = base
        self.max_cache_len = max_cache_len
        self.cache = verification_cache(base.config, max_cache_len)
        # Half precision: position-ordered attention and, on AVX512-BF16 or AVX2 CPUs, hf_bpd's row-invariant kernels
        # (`hf_bpd.runtime.kernels`): a block's rows round as one-token steps do, so drafting never changes the output.
        self.ordered = uses_ordered_attention(base)
        self.packed = packed_base(base) if self.ordered else None
        self.step = VerificationStep(self.packed if self.packed is not None else base, self.cache).eval()
        self.attention_kernel = self.packed is not None and kv_layout(base.config)[1] % 16 == 0  # its head dims
        # Inductor settings: `_Patches` around each compiling call (as `torch.compile(options=...)` they did not enable
        # the GEMM templates, which make a step much faster; set globally they would change the user's own compiles).
        # Guards: `hf_bpd.runtime.guards`.
        self._compiled = None  # `torch.compile(self.step)`, made on first use (importing inductor is slow)
        # Grouped key/value heads are read in place, not copied per query head (`hf_bpd.runtime.attention`); the
        # switch is on in every call of the compiled step.
        self.grouped = uses_grouped_attention(base)
        # The static cache allocates its tensors lazily, in its first update: do that now, eagerly, or the first
        # compiled call traces the allocation (guard `is_initialized == False`) and the next one compiles again, so
        # the first block length would compile twice.
        with torch.no_grad():
            device = base.device
            one = torch.zeros(1, 1, dtype=torch.long, device=device)
            with self.attention():
                self.step(one, one, one[0], torch.zeros(1, 1, 1, max_cache_len, dtype=base.dtype, device=device),
                          *self.key_order(1, device))
        self.heads_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # heads -> {top_k: compiled}
        self.lock = threading.RLock()  # warm_up may run inside a caller that holds it
        self.reset()
        self.compiled_buckets: dict[int, float] = {}  # block length -> seconds its first call took (compilation)
        self.bucket_ms: dict[int, float] = {}  # block length -> median ms of the step (timed after compiling)
        self.compiled_heads: dict[tuple[int, int], float] = {}  # (id(heads), top_k) -> seconds compiling took
        self.context: torch.Tensor | None = None  # the tokens whose keys/values the cache holds, from the last call
        self.context_stamp = 0  # when that call ended (`_CALLS`): the newest context is the one to continue

    @property
    def compiled(self):
        if self._compiled is None:
            self._compiled = compile_step(self.step)
        return self._compiled

    def attention(self):
        """The attention the steps run on: position-ordered for half precision, else PyTorch's grouped kernel."""
        if self.ordered:
            return attention_implementation(
                self.base, ORDERED_KERNEL_ATTENTION if self.attention_kernel else ORDERED_ATTENTION)
        return grouped_query_attention(self.base, self.grouped)

    def key_order(self, rows: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Ordered attention's identity `(key_slots, key_ranks)` for `rows` query rows (Nones for other bases)."""
        return identity_key_order(rows, self.max_cache_len, device) if self.ordered else (None, None)

    def run(self, input_ids, position_ids, cache_position, attention_mask, order=None):
        """One step over the block `input_ids`; `order`: ordered attention's maps (default: `key_order`'s)."""
        q = input_ids.shape[1]
        order = order if order is not None else self.key_order(q, input_ids.device)
        with self.attention():
            if q in self.compiled_buckets:  # compiled: the settings only matter while compiling (patching costs time)
                done = call_compiled(self.compiled, input_ids, position_ids, cache_position, attention_mask, *order)
                if done is not None:
                    return done
            start = time.perf_counter()
            with _Patches(self.ordered):
                logits, hidden = self.compiled(input_ids, position_ids, cache_position, attention_mask, *order)
        self.compiled_buckets[q] = time.perf_counter() - start
        return logits, hidden

    def heads_step(self, heads, top_k: int, int8: bool | None = False, blocking: bool = True):
        """The compiled heads step for `heads` at lattice width `top_k`: `(hidden (hidden_size,), next token) ->
        (values, indices)`; with `int8` (True, or None for "where it can"), the int8 kernel's step on CPU instead
        (`int8_heads_step`). Without `blocking`, nothing is compiled or built: None (draft eagerly) when neither
        step is ready."""
        if int8 is not False and (blocking or kernel_file().exists()):
            step = int8_heads_step(heads, top_k, warn=int8 is True)
            if step is not None:
                return step
        by_width = self.heads_steps.setdefault(heads, {})
        if top_k not in by_width and not blocking:
            return None
        if top_k not in by_width:
            compiled = torch.compile(_HeadsStep(heads, top_k).eval(), dynamic=False)
            key = (id(heads), top_k)

            done = []  # this step has compiled (its first call)

            def run(hidden, token):
                token = torch.as_tensor(token, dtype=torch.long, device=hidden.device)
                if done:  # the settings only matter while compiling (see `run`)
                    return compiled(hidden, token)
                start = time.perf_counter()
                with _Patches():
                    out = compiled(hidden, token)
                self.compiled_heads[key] = time.perf_counter() - start
                done.append(True)
                return out

            by_width[top_k] = run
        return by_width[top_k]

    def warm_up(self, buckets, device, heads=None, top_k: int = 0, int8: bool | None = False,
                blocking: bool = True) -> dict[int, float]:
        """Compile the verification steps of `buckets` (block lengths), and the heads step when `heads` are given,
        now (outside any timed region), and time each step; returns `{block length: seconds compiling took}`.
        Without `blocking`, a heads step that is not ready is not compiled (see `heads_step`)."""
        with self.lock, torch.no_grad():
            if heads is not None:  # heads_int8=True warns when unserved: once, when the decoding loop takes the step
                step = self.heads_step(heads, top_k, None if int8 else int8, blocking)
                if step is not None:
                    step(torch.zeros(self.base.config.get_text_config().hidden_size, dtype=self.base.dtype,
                                     device=device), 0)
            # lengths compiled and timed already are skipped (a step compiled by `run` is timed here)
            pending = [b for b in buckets if not (b in self.compiled_buckets and b in self.bucket_ms)]
            # the warm-up writes after the cached context (`take_context`), which stays valid
            past = len(self.context) if self.context is not None else 0
            if pending and past + max(pending) > self.max_cache_len:
                self.context, past = None, 0
            steps = {b: (torch.zeros(1, b, dtype=torch.long, device=device), past + torch.arange(b, device=device),
                         torch.zeros(1, 1, b, self.max_cache_len, dtype=self.base.dtype, device=device))
                     for b in pending}
            # the first two calls of each compile and warm the step up; then the lengths are timed in turns (the
            # first steps after a load run slower, so timing one length after another would overprice the first),
            # each call on a frame-stack chunk of its own, as decoding runs it (`hf_bpd.runtime.frame_stack`); the
            # median of `TIMED_CALLS` is the cost draft_schedule="cost" reads
            times = {b: [] for b in pending}
            for turn in range(2 + TIMED_CALLS):
                for b in pending:
                    tokens, positions, mask = steps[b]
                    took = on_fresh_frame_stack(self._time_step, 1, past, tokens, positions, mask)[0]
                    if turn >= 2:
                        times[b].append(took)
            for b in pending:
                self.bucket_ms[b] = 1000 * sorted(times[b])[TIMED_CALLS // 2]
            self.reset()
        return dict(self.compiled_buckets)

    def _time_step(self, calls: int, past: int, tokens, positions, mask) -> list[float]:
        times = []
        for _ in range(calls):
            self.set_length(past)
            start = time.perf_counter()
            self.run(tokens, positions[None], positions, mask)
            times.append(time.perf_counter() - start)
        return times

    def take_prefix(self, prompt: torch.Tensor) -> int:
        """How many leading tokens of `prompt` (1D) the cache holds from the last call (`context`), at most all but
        the last one (the prompt pass must compute the last position's logits); the cache is then this call's, so
        `context` is cleared until the call closes."""
        context, self.context = self.context, None
        if context is None or len(context) == 0:
            return 0
        n = min(len(context), len(prompt) - 1)
        if n <= 0:
            return 0
        differ = (context[:n] != prompt[:n].to(context.device)).nonzero()
        return int(differ[0]) if len(differ) else n

    def take_context(self, other: CompiledRunner) -> None:
        """Move `other`'s cached context (its tokens' keys/values) into this runner's larger cache."""
        n = len(other.context)
        with torch.no_grad():
            for mine, theirs in zip(self.cache.layers, other.cache.layers):
                mine.keys[:, :, :n].copy_(theirs.keys[:, :, :n])
                mine.values[:, :, :n].copy_(theirs.values[:, :, :n])
        self.context, other.context = other.context, None
        self.context_stamp = other.context_stamp

    def keep_context(self, tokens: torch.Tensor) -> None:
        """A call ended with `tokens`' keys/values in the cache: the next call may continue from them."""
        self.context = tokens
        self.context_stamp = next(_CALLS)

    def set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)

    def reset(self) -> None:
        self.set_length(0)


def _ordered(table: dict[int, float]) -> bool:
    """Whether no block of `table` (`{block length: ms}`) timed more than `SANE_DROP` under a shorter one."""
    times = [ms for _, ms in sorted(table.items())]
    return all(ms >= (1 - SANE_DROP) * shorter for shorter, ms in zip(times, times[1:]))


class ArtifactRunner(CompiledRunner):
    """A runner whose verification step is a prebuilt artifact (`hf_bpd.runtime.artifacts`), loaded, not compiled:
    it serves blocks of 1 to `artifacts.MAX_BLOCK` tokens over the used part of the cache. A longer block runs the
    same step eagerly on the same cache, or, with `blocking` (`compile="wait"`), takes the `torch.compile` path of
    `CompiledRunner`. The block lengths `warm_up` times (the cost schedule's table) are timed once per machine and
    kept beside the artifact (`KeptCosts`, entry `ONE_ROW`): a new process's first call reads them instead of timing
    `2 + TIMED_CALLS` steps of each, a noticeable part of a first call; a kept table this process's steps contradict is
    dropped, and the next call's `warm_up` times every length again and keeps those."""

    kind = "artifact"

    def __init__(self, base, max_cache_len: int, artifact):
        from .artifacts import MAX_BLOCK

        super().__init__(base, max_cache_len)
        self.artifact, self.max_block = artifact, MAX_BLOCK
        self.kv = [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        self.blocking = False  # set per call: whether a block over `max_block` may compile
        self._read_kept()

    def _read_kept(self) -> None:
        """The kept costs of the blocks the artifact serves as this runner's (nothing to compile, already timed)."""
        self.kept = KeptCosts(self.artifact, ONE_ROW)
        for block, ms in self.kept.table.items():
            if block <= self.max_block:
                self.compiled_buckets.setdefault(block, 0.0)
                self.bucket_ms[block] = ms

    def warm_up(self, buckets, device, heads=None, top_k: int = 0, int8: bool | None = False,
                blocking: bool = True) -> dict[int, float]:
        """`CompiledRunner.warm_up`; block lengths the artifact serves that it timed now are kept beside it (best
        effort: a read-only cache only means timing them again)."""
        known = set(self.bucket_ms)
        out = super().warm_up(buckets, device, heads, top_k, int8, blocking)
        timed = {b: ms for b, ms in self.bucket_ms.items() if b not in known and b <= self.max_block}
        if timed:
            # the kept table with these timings, or, when they disagree with what it kept (timed on a loaded machine,
            # say), these alone; none when a longer block of them timed clearly faster than a shorter one (noise: the
            # next process times again; this call uses them, as any call did before the table was kept)
            kept = {b: ms for b, ms in self.kept.table.items() if b <= self.max_block}
            table = next((t for t in ({**kept, **timed}, timed) if _ordered(t)), None)
            if table is not None:
                self.kept.keep(table)
        return out

    def _check_kept(self, block: int, ms: float) -> None:
        """A step of `block` tokens took `ms`: checked against its kept cost; a kept table its steps contradict is
        dropped (`KeptCosts.contradicted`), and `warm_up` times what is then missing."""
        if self.kept.contradicted(block, ms):
            for kept in [b for b in self.bucket_ms if b <= self.max_block]:
                del self.bucket_ms[kept]

    def run(self, input_ids, position_ids, cache_position, attention_mask, order=None):
        q = input_ids.shape[1]
        if q > self.max_block:
            # position-ordered bases: only the compiled step's rows equal the artifact's (an eager block would not)
            if self.blocking or self.ordered:
                self.last_kind = "compiled"
                return super().run(input_ids, position_ids, cache_position, attention_mask, order)
            self.last_kind = "eager"
            with grouped_query_attention(self.base, self.grouped):
                return self.step(input_ids, position_ids, cache_position, attention_mask)
        start = time.perf_counter()
        if self.ordered:  # the whole cache's mask and key order (the kernel reads the slots some row can see)
            order = order if order is not None else self.key_order(q, input_ids.device)
            logits, hidden = self.artifact(input_ids, position_ids, attention_mask.contiguous(), cache_position[0],
                                           self.kv, order)
        else:
            attended = int(cache_position[-1]) + 1  # the cached tokens and this block; the slots after it are unread
            mask = attention_mask[..., :attended].contiguous()
            logits, hidden = self.artifact(input_ids, position_ids, mask, cache_position[0], self.kv)
        if q in self.kept:
            self._check_kept(q, 1000 * (time.perf_counter() - start))
        self.last_kind = "artifact"
        self.compiled_buckets.setdefault(q, 0.0)  # nothing compiled in this process
        return logits, hidden


_CALLS = itertools.count(1)  # compiled calls that ended, in order
# base model -> {(kind, max_cache_len): runner}: an artifact runner replaces the compiling one once an artifact exists
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WEIGHTS_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> its weights' marker at the last call


def compiled_runner(base, needed_length: int, artifact=None) -> CompiledRunner:
    """The runner of `base` whose static cache holds `needed_length` tokens, running `artifact` (an
    `ArtifactRunner`) or compiling (`CompiledRunner`, when `artifact` is None): the smallest one of that kind that
    exists (its compiled steps are reused), else a new one (created, not compiled) rounded up to `CACHE_BUCKET`
    tokens."""
    if weights.changed_since(base, _WEIGHTS_SEEN):  # its runners' graphs hold the old weights
        discard_runners(base)
    runners = _RUNNERS.setdefault(base, {})
    kind = "compiled" if artifact is None else "artifact"
    for key in [k for k, r in runners.items() if k[0] == "artifact" and r.artifact is not artifact]:
        del runners[key]  # built on another artifact (of this base's earlier weights)
    fitting = [size for k, size in runners if k == kind and size >= needed_length]
    if fitting:
        runner = runners[kind, min(fitting)]
    else:
        size = -(-needed_length // CACHE_BUCKET) * CACHE_BUCKET
        runner = ArtifactRunner(base, size, artifact) if artifact is not None else CompiledRunner(base, size)
        runners[kind, size] = runner
    # the latest call's context may sit in another runner (a conversation outgrew its cache): it moves along
    latest = max((r for (k, _), r in runners.items() if k == kind and r is not runner and r.context is not None
                  and len(r.context) < runner.max_cache_len), key=lambda r: r.context_stamp, default=None)
    if latest is not None and (runner.context is None or latest.context_stamp > runner.context_stamp):
        with latest.lock, runner.lock:
            runner.take_context(latest)
    return runner


def discard_runners(base) -> None:
    """Forget `base`'s runners and their compiled steps (after a failed compile: the next call starts afresh)."""
    _RUNNERS.pop(base, None)
    from . import artifacts, packed_linear

    artifacts.forget(base)
    packed_linear.forget(base)
