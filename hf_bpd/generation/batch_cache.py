"""The KV cache of a batch whose rows accept different numbers of tokens per step ("ragged rows on one cache").

Both layouts keep the batch's keys/values in one tensor per layer, `P` slots long, and `valid` (a `(rows, P)` bool
mask) says which slots hold which row's tokens, in order. A step appends every row's block (its last token and its
draft tree, padded to the widest block `W` of the step) at slots `P .. P+W-1`. After verification, row `r` keeps its
root and accepted path, `k_r` entries; the slots it does not keep are holes, masked from then on. Compacting gathers
each row's valid slots to the right (left padding).

* `RaggedCache`: a `DynamicCache` verified by the eager base. Row `r`'s kept entries move to the front of the block,
  the cache grows by `K = max_r k_r` (row `r` leaves `K - k_r` holes) and the tail past `K` is cut; the cache is
  compacted when that would free a quarter of it; a row that finishes leaves (its cache row is dropped).
* `StaticRaggedCache`: the static cache of a compiled batched step (`hf_bpd.runtime.batched`). A step's mask spans
  all `max_cache_len` slots and its attention reads the slots up to the block, so a hole costs one masked slot until
  the cache is full: it is compacted then. Nothing moves after a verification: the slots a row rejected stay where
  they are, as holes, and the cache grows to the last slot any row kept (moving every layer's kept entries would
  cost time on every step). On a runner with dynamic rows (a prebuilt step) a finished row leaves at once: an
  active row held past the active count moves into its cache row, and steps compute the first `active` rows only.
  On a runner compiled per shape, finished rows stay in the step (masked, their results unread) until the rows left
  fit a runner of a quarter as many rows (`SHRINK`; runners of 1, 4, 16, ... rows): they move there, so the shapes
  a process compiles stay few and are reused.
"""

from __future__ import annotations

import torch

from ..runtime import execution

COMPACT_HOLES = 0.25  # a dynamic cache is compacted when compacting would free this share of its slots
SHRINK = 4  # a static cache's rows move to a runner of 1/SHRINK as many rows once they fit it (few shapes to compile)


def _states(cache):
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0]


def _slot_index(index: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """`(rows, n)` slot indices as a `gather` index over `states` `(rows, heads, slots, head_dim)`."""
    return index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])


def _gather_block(layers, past: int, block: int, kept: list[list[int]], rows: int, device) -> int:
    """Move row r's kept block slots `kept[r]` (row-relative, in order) to the front of the block at `past`, in place;
    returns how many slots the longest kept list fills."""
    width = max((len(k) for k in kept), default=0)
    index = torch.tensor([k + [0] * (width - len(k)) for k in kept], device=device).reshape(rows, width)
    for layer in layers:
        gather = _slot_index(index, layer.keys) + past
        for name in ("keys", "values"):
            states = getattr(layer, name)
            states[..., past: past + width, :] = states[..., : past + block, :].gather(2, gather)
    return width


def _compaction(valid: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`(order, compacted valid)`: `order[r]` the slots of row r to gather, its valid ones last and in order (None
    when no row holds any), so every row's tokens end at the same slot (left padding), without holes."""
    counts = valid.sum(-1)
    width = int(counts.max())
    order = torch.sort(valid.long(), dim=1, stable=True).indices[:, -width:] if width else None
    return order, torch.arange(width, device=valid.device)[None] >= (width - counts)[:, None]


def _copy_rows(runner, layers, count: int, length: int, rows: torch.Tensor | None = None) -> None:
    """Copy the first `length` slots of `layers`' rows `rows` (all when None) into the first `count` rows of
    `runner`'s static cache."""
    with torch.no_grad():
        for mine, theirs in zip(runner.layers, layers):
            for name in ("keys", "values"):
                states = getattr(theirs, name)[..., :length, :]
                getattr(mine, name)[:count, :, :length].copy_(states if rows is None else states[rows])


def position_order(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An additive slot mask `(rows, 1, W, S)` as ordered attention's `(mask by position, key_slots (rows, W, S))`:
    query i of row r reads its open slots in slot order as positions 0, 1, ... (a row's kept slots hold its tokens in
    order, a block's ancestors precede their descendants), the other slots after them, closed."""
    closed = mask[:, 0] < 0
    key_slots = torch.sort(closed.to(torch.uint8), dim=-1, stable=True).indices
    opened = (~closed).sum(-1, keepdim=True)
    by_position = torch.arange(mask.shape[-1], device=mask.device) >= opened
    return torch.zeros_like(mask).masked_fill_(by_position[:, None], torch.finfo(mask.dtype).min), key_slots


def _kept_mask(kept: list[list[int]], width: int, device) -> torch.Tensor:
    lengths = torch.tensor([len(k) for k in kept], device=device)
    return torch.arange(width, device=device)[None] < lengths[:, None]


class RaggedCache:
    """The batch's `DynamicCache` plus which slots hold which row's tokens (see the module docstring)."""

    def __init__(self, cache, valid: torch.Tensor):
        self.cache, self.valid = cache, valid  # valid: (rows, P) bool

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def counts(self) -> torch.Tensor:
        return self.valid.sum(-1)

    @property
    def step_rows(self) -> int:
        """The rows a step computes (here: the active rows)."""
        return self.valid.shape[0]

    @staticmethod
    def rows_computed(active: int) -> int:
        """The rows a step will compute once `active` rows are left: those."""
        return active

    def step_costs(self) -> dict[int, float]:
        """`{tokens: ms}` of steps known before the call's own (none for the eager base)."""
        return {}

    def measured_costs(self, max_width: int) -> dict[int, float]:
        """`{tokens: ms}` of this cache's steps timed on it before the call's own (none for the eager base)."""
        return {}

    def make_room(self, width: int) -> None:
        """A dynamic cache grows as it needs."""

    def forward(self, model, tokens, positions, masks) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The eager base over the block: `(logits, hidden, compiled)` (compiled: False)."""
        from ..kv_cache import CACHE_NAME

        out = model(input_ids=tokens, attention_mask=masks, position_ids=positions, **{CACHE_NAME: self.cache},
                    use_cache=True, return_head_logits=False)
        return out.logits, out.last_hidden_state, False

    def keep_tail(self, block: int, kept: list[list[int]]) -> None:
        """After a verification of `block` slots per row: keep row r's block slots `kept[r]` (in order), cut the
        tail to the longest kept list."""
        device = self.valid.device
        if block == 1:  # plain steps: every row keeps its one new slot where it is
            self.valid = torch.cat([self.valid, torch.ones(len(kept), 1, dtype=torch.bool, device=device)], dim=1)
            return
        layers = _states(self.cache)
        past = self.length
        width = _gather_block(layers, past, block, kept, len(kept), device)
        for layer in layers:  # the cut is a view (the next append copies)
            layer.keys, layer.values = layer.keys[..., : past + width, :], layer.values[..., : past + width, :]
        self.valid = torch.cat([self.valid, _kept_mask(kept, width, device)], dim=1)
        if 1 - int(self.counts().max()) / self.length > COMPACT_HOLES:  # what compacting would free
            self.compact()

    def compact(self) -> None:
        """Gather every row's valid slots to the right end (left padding): no holes."""
        order, self.valid = _compaction(self.valid)
        for layer in _states(self.cache):
            gather = _slot_index(order, layer.keys)
            layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (finished rows leave)."""
        for layer in _states(self.cache):
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)


class StaticRaggedCache:
    """The static cache of a compiled batched step, as a `RaggedCache` (see the module docstring).

    Args:
        runner: a batched runner (`execution.batch_runner`) with at least as many rows as the batch.
        cache: the prompt pass's `DynamicCache` (`(rows, heads, P, head_dim)` per layer), copied in.
        valid: `(rows, P)` its valid slots.
    """

    def __init__(self, runner, cache, valid: torch.Tensor):
        rows, length = valid.shape
        self.runner = runner
        self.rows = torch.arange(rows, device=valid.device)  # each active row's row in the static cache
        self.dynamic = runner.dynamic_rows  # a step computes the active rows only (kept in the first cache rows)
        self.all_valid = torch.zeros(runner.rows, length, dtype=torch.bool, device=valid.device)
        self.all_valid[:rows] = valid
        if cache is not None:
            _copy_rows(runner, cache.layers, rows, length)
        runner.set_length(length)

    @classmethod
    def prefilled(cls, runner, model, input_ids: torch.Tensor, valid: torch.Tensor, needed_length: int):
        """`(cache, last logits (rows, vocab), last hidden states (rows, hidden_size))` of the prompt pass on an
        ordered runner: each row's prompt runs alone on the base's single-sequence compiled runner, as a lone call's
        prompt pass does (`CompiledVerifier.prefill`), and its keys/values are copied to the row's slots here."""
        single, prefill = execution.lone_prefill(model, needed_length)
        logits, hidden = [], []
        with single.lock, torch.no_grad():
            for r in range(valid.shape[0]):
                prompt = input_ids[r, valid[r]][None]
                row_logits, row_hidden = prefill(prompt)
                logits.append(row_logits[0])
                hidden.append(row_hidden)
                n, length = prompt.shape[1], valid.shape[1]
                for mine, theirs in zip(runner.layers, single.cache.layers):
                    mine.keys[r, :, length - n: length].copy_(theirs.keys[0, :, :n])
                    mine.values[r, :, length - n: length].copy_(theirs.values[0, :, :n])
            single.reset()
        return cls(runner, None, valid), torch.stack(logits), torch.stack(hidden)

    @property
    def valid(self) -> torch.Tensor:
        """`(active rows, P)`."""
        return self.all_valid.index_select(0, self.rows)

    @property
    def length(self) -> int:
        return self.all_valid.shape[1]

    def counts(self) -> torch.Tensor:
        return self.valid.sum(-1)

    @property
    def step_rows(self) -> int:
        """The rows a step computes: the active ones on a dynamic-rows runner (the first cache rows), else the
        runner's (finished rows included)."""
        return len(self.rows) if self.dynamic else self.runner.rows

    def rows_computed(self, active: int) -> int:
        """The rows a step will compute once `active` rows are left (see `select`)."""
        return active if self.dynamic else self._runner_rows(active)

    def _runner_rows(self, count: int) -> int:
        """The rows of the runner `count` active rows step on: this runner's until they fit one of a quarter as many
        (`SHRINK`), then the next power of `SHRINK`."""
        if count > self.runner.rows // SHRINK:
            return self.runner.rows
        size = 1
        while size < count:
            size *= SHRINK
        return size

    def step_costs(self) -> dict[int, float]:
        """`{tokens: ms}` of the runner's compiled steps, timed when they compiled."""
        return {self.runner.rows * w: ms for w, ms in self.runner.width_ms.items()}

    def measured_costs(self, max_width: int) -> dict[int, float]:
        """`{tokens: ms}` of the runner's steps of up to `max_width` tokens a row, timed on it (a prebuilt step's
        runner; empty for runners compiled per shape, timed as they compile: `step_costs`)."""
        measure = getattr(self.runner, "measured_costs", None)
        return measure(max_width) if measure is not None else {}

    def make_room(self, width: int) -> None:
        """Compact when a block of `width` would not fit (call before the step's masks are built)."""
        if self.length + width > self.runner.max_cache_len:
            self.compact()
        if self.length + width > self.runner.max_cache_len:
            raise RuntimeError(f"a block of {width} does not fit the batch's compiled cache")

    def forward(self, model, tokens, positions, masks) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The compiled step over the block (over the active rows on a dynamic-rows runner, else every row of the
        runner, finished ones masked): `(logits, hidden, compiled)` of the
        active rows; `compiled`: this call compiled the step's shape."""
        runner, rows, length = self.runner, self.rows, self.length
        width, device = tokens.shape[1], tokens.device
        computed = self.step_rows if not self.dynamic or width <= runner.max_block else runner.rows
        all_tokens = torch.zeros(computed, width, dtype=tokens.dtype, device=device)
        all_positions = torch.zeros(computed, width, dtype=positions.dtype, device=device)
        all_tokens[rows], all_positions[rows] = tokens, positions
        diagonal = length + torch.arange(width, device=device)

        def pad(mask):  # (rows, 1, W, P + W) -> (computed rows, 1, W, max_cache_len); other rows see themselves
            full = torch.full((computed, 1, width, runner.max_cache_len), torch.finfo(mask.dtype).min,
                              dtype=mask.dtype, device=device)
            full[:, 0, torch.arange(width, device=device), diagonal] = 0.0
            full[rows, :, :, : length + width] = mask
            return full

        full_masks = {k: pad(m) for k, m in masks.items()} if isinstance(masks, dict) else pad(masks)
        with torch.no_grad():
            if runner.ordered:  # each query over its own sequence in position order
                logits, hidden, compiled = runner.run(all_tokens, all_positions, *position_order(full_masks))
            else:
                logits, hidden, compiled = runner.run(all_tokens, all_positions, full_masks)
        return logits.index_select(0, rows), hidden.index_select(0, rows), compiled

    def _gather_prefix(self, count: int) -> None:
        """Move the active rows held past the first `count` cache rows into the finished rows' places there."""
        cache_rows = self.rows.tolist()
        holes = sorted(set(range(count)) - set(cache_rows))
        movers = [i for i, row in enumerate(cache_rows) if row >= count]
        length = self.length
        with torch.no_grad():
            for hole, i in zip(holes, movers):
                source = cache_rows[i]
                for layer in self.runner.layers:
                    layer.keys[hole, :, :length].copy_(layer.keys[source, :, :length])
                    layer.values[hole, :, :length].copy_(layer.values[source, :, :length])
                self.all_valid[hole] = self.all_valid[source]
                cache_rows[i] = hole
        self.rows = torch.tensor(cache_rows, dtype=torch.long, device=self.all_valid.device)

    def keep_tail(self, block: int, kept: list[list[int]]) -> None:
        """After a verification of `block` slots per row: keep active row r's block slots `kept[r]` where they are
        (nothing moves: the slots it rejected become holes); the cache grows to the last slot any row kept."""
        device, past = self.all_valid.device, self.length
        if block == 1:
            tail = torch.zeros(self.runner.rows, 1, dtype=torch.bool, device=device)
            tail[self.rows] = True
            self.all_valid = torch.cat([self.all_valid, tail], dim=1)
            self.runner.set_length(past + 1)
            return
        width = max(max(k) for k in kept) + 1
        slots = [[r, s] for r, k in zip(self.rows.tolist(), kept) for s in k]
        tail = torch.zeros(self.runner.rows, width, dtype=torch.bool, device=device)
        tail[tuple(torch.tensor(slots, device=device).T)] = True
        self.all_valid = torch.cat([self.all_valid, tail], dim=1)
        self.runner.set_length(past + width)

    def compact(self) -> None:
        """Gather every row's valid slots to the right end of the used part (left padding): no holes."""
        order, valid = _compaction(self.all_valid)
        width = valid.shape[1]
        with torch.no_grad():
            for layer in self.runner.layers if order is not None else ():
                gather = _slot_index(order, layer.keys)
                for name in ("keys", "values"):
                    states = getattr(layer, name)
                    states[..., :width, :] = states[..., : self.length, :].gather(2, gather)
        self.all_valid = valid
        self.runner.set_length(width)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only active rows `rows` (finished rows leave). On a dynamic-rows runner the active rows move into the
        first cache rows (a row past them fills a finished row's place) and steps compute only those; else the batch
        moves to a runner of fewer rows when they fit one."""
        self.rows = self.rows.index_select(0, rows)
        count = len(self.rows)
        if self.dynamic:
            self._gather_prefix(count)
            return
        size = self._runner_rows(count)
        if count == 0 or size == self.runner.rows:
            return
        smaller = execution.smaller_batch_runner(self.runner, size)
        if smaller is None or smaller is self.runner:
            return
        length = self.length
        _copy_rows(smaller, self.runner.layers, count, length, self.rows)
        valid = torch.zeros(size, length, dtype=torch.bool, device=self.all_valid.device)
        valid[:count] = self.valid
        self.all_valid, self.runner = valid, smaller
        self.rows = torch.arange(count, device=valid.device)
        smaller.set_length(length)
