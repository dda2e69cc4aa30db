"""`CompiledVerifier`: one call's verification on a `CompiledRunner`'s compiled steps and static cache (see
`hf_bpd.runtime.compiled`), with the interface of `hf_bpd.generation.verify.EagerVerifier`; the decoding loop picks one.
Half-precision bases with hf_bpd's kernels (`hf_bpd.runtime.packed_linear`) run the prompt pass through the runner's
packed module tree too: plain and drafted decoding share it, and it is what makes their first step fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kv_cache import CACHE_NAME
from .attention import grouped_query_attention
from .compiled import CompiledRunner
from .ordered_attention import block_key_order, placed_key_order

if TYPE_CHECKING:
    from ..generation.tree import DraftTree

MAX_TREE_PATTERNS = 4096  # tree shapes whose block masks one call keeps


class CompiledVerifier:
    """Verification with `CompiledRunner`'s compiled steps on its static cache (see the module docstring)."""

    @property
    def kind(self) -> str:
        """What ran the last verification: "artifact", "compiled" or "eager" (a block longer than an artifact
        serves, `ArtifactRunner`)."""
        return self.runner.last_kind

    def __init__(self, model, runner: CompiledRunner):
        self.model, self.base, self.runner = model, model.base_lm, runner
        self.cache = runner.cache
        self.length = 0  # tokens in the cache
        self.reused = 0  # prompt tokens the cache held from the last call (`prefill`)
        self.buckets = [1]  # the compiled block lengths this call uses; a block is padded to the next one
        self._masks: dict[int, list] = {}  # block length -> [mask buffer, open columns, written columns]
        self._patterns: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # tree shape -> (depths, block mask)
        self._aranges: dict[int, torch.Tensor] = {}

    def prefill(self, input_ids: torch.Tensor, all_positions: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt pass, not compiled, writing into the static cache (the call holds the runner's lock from here
        on): through the runner's packed module tree where it has one (hf_bpd's kernels), else the model as loaded.
        The cache still holds the last call's context: with an fp32 base the prompt's longest prefix found there is
        kept and only the rest runs (a growing conversation passes only its new turn). `all_positions`: the whole
        prompt runs and the hidden states of every position come back, `(n, hidden_size)` (a feature-level drafter
        reads them)."""
        reused = self.runner.take_prefix(input_ids[0])
        # Half precision rounds a prompt token's keys and values differently when it ran in another call's prompt
        # pass (another block of rows), and greedy choices flip at its many near-ties: a call recomputes its prompt
        # there, so its output never depends on the call before it. fp32 keeps the reuse (the near-tie referee
        # settles what rounding could change).
        reused = 0 if all_positions or self.base.dtype not in (torch.float32, torch.float64) else reused
        self.runner.set_length(reused)
        self.reused = reused
        rest = input_ids[:, reused:]
        positions = torch.arange(reused, input_ids.shape[1], device=input_ids.device)
        with grouped_query_attention(self.base, self.runner.grouped):
            packed = self.runner.packed
            if packed is not None:  # hf_bpd's kernels (the hidden states' last entry is the final, normed one)
                out = packed(input_ids=rest, **{CACHE_NAME: self.cache}, use_cache=True, cache_position=positions,
                             position_ids=positions[None], logits_to_keep=1, output_hidden_states=True)
                hidden = out.hidden_states[-1]
            else:
                extra = {"output_hidden_states": True} if all_positions else {}
                out = self.model(input_ids=rest, **{CACHE_NAME: self.cache}, use_cache=True, cache_position=positions,
                                 position_ids=positions[None], return_head_logits=False, logits_to_keep=1, **extra)
                hidden = out.hidden_states[-1] if all_positions else out.last_hidden_state
        logits = out.logits[:, -1]
        self.length = input_ids.shape[1]
        self.runner.set_length(self.length)
        return logits, hidden[0] if all_positions else hidden[0, -1]

    def verify(self, last_token: int, tree: DraftTree, device) -> tuple[torch.Tensor, torch.Tensor]:
        q = len(tree) + 1
        b = next((x for x in self.buckets if x >= q), q)  # the smallest compiled shape that holds the block
        past = self.length
        tokens = torch.tensor([[last_token] + tree.tokens + [0] * (b - q)], dtype=torch.long, device=device)
        depths, block, order = self._block_pattern(tree, b, device)
        mask = self._mask(b, past, block, device)
        # ordered attention: each row reads its ancestors at their positions
        maps = None if order is None else placed_key_order(order, past, self.runner.max_cache_len, device)
        logits, hidden = self.runner.run(tokens, (past + depths)[None], past + self._arange(b, device), mask, maps)
        return logits[0, :q], hidden[0, :q]

    def _block_pattern(self, tree: DraftTree, b: int, device):
        """`(depths (b,), additive mask (b, b), order)` of the block. Slot order (`order` None): each node sees the
        root and its ancestors; padding rows see themselves only (no row may see nothing). Position order (ordered
        attention): column `j` of row `i` is the row's position `past + j`, open up to the row's depth, and
        `order = (slots, ranks)`: `slots[i, j]` is the block slot holding it (the row's ancestor at depth `j`, then the
        row's other block slots in order, closed; padding rows read the block in slot order), `ranks` the inverse.
        Kept per tree shape (a call meets few)."""
        key = (b, tuple(tree.parents))
        pattern = self._patterns.get(key)
        if pattern is None:
            q = len(tree) + 1
            depths = torch.arange(b, dtype=torch.long)
            depths[:q] = tree.block_depths()
            order = None
            if self.runner.ordered:
                allowed = torch.arange(b)[None, :] <= depths[:, None]
                order = tuple(t.to(device) for t in block_key_order(tree.parents, b))
            else:
                allowed = torch.eye(b, dtype=torch.bool)
                allowed[:q, :q] = tree.ancestors_mask()
            block = torch.zeros(b, b, dtype=self.base.dtype)
            block.masked_fill_(~allowed, torch.finfo(self.base.dtype).min)
            pattern = (depths.to(device), block.to(device), order)
            if len(self._patterns) < MAX_TREE_PATTERNS:
                self._patterns[key] = pattern
        return pattern

    def _arange(self, b: int, device) -> torch.Tensor:
        if b not in self._aranges:
            self._aranges[b] = torch.arange(b, device=device)
        return self._aranges[b]

    def _mask(self, b: int, past: int, block: torch.Tensor, device) -> torch.Tensor:
        """The `(1, 1, b, max_cache_len)` additive mask over the static cache: the `past` cached tokens open to every
        row, the block's own pattern after them, the rest closed. One buffer per block length, updated in place
        from the last step's (only the columns that changed are written)."""
        closed = torch.finfo(self.base.dtype).min
        state = self._masks.get(b)
        if state is None:
            state = self._masks[b] = [torch.full((b, self.runner.max_cache_len), closed, dtype=self.base.dtype,
                                                 device=device), 0, 0]
        mask, opened, written = state  # columns [0, opened) are open; [opened, written) may hold an old block
        if past > opened:
            mask[:, opened:past] = 0.0
        elif past < opened:
            mask[:, past:opened] = closed
        if written > past + b:
            mask[:, past + b:written] = closed
        mask[:, past:past + b] = block
        state[1], state[2] = past, past + b
        return mask[None, None]

    def keep(self, block_length: int, kept: list[int]) -> None:
        past = self.length
        if kept != list(range(len(kept))):
            source = torch.tensor(kept, device=self.cache.layers[0].keys.device) + past
            target = past + torch.arange(len(kept), device=source.device)
            for layer in self.cache.layers:
                layer.keys.index_copy_(2, target, layer.keys.index_select(2, source))
                layer.values.index_copy_(2, target, layer.values.index_select(2, source))
        self.length = past + len(kept)
        self.runner.set_length(self.length)

    def close(self, length: int, sequence: torch.Tensor | None = None) -> object:
        self.length = min(self.length, length - 1)
        self.runner.set_length(self.length)
        if sequence is not None:  # the next call may start from this context (`prefill`)
            self.runner.keep_context(sequence[0, :self.length].clone())
        return None  # the static cache is the runner's, reused by the next call: it is not handed out
