"""Draft trees: several drafts verified in one base forward pass over one KV cache (p-best drafts, Medusa trees).

The verification input is the last decoded token (the root, not yet in the cache) followed by the tree's nodes. A 4D
attention mask lets every node see the cache, the root and its own ancestors only; position ids are
`past_length + depth`. After verification the accepted path's cache entries are moved to the front of the new block
and the rest is cropped, so the cache again holds exactly the decoded sequence.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from ..errors import BPDConfigError
from ..limits import MAX_DRAFT_NODES

MAX_TREE_NODES = MAX_DRAFT_NODES  # tokens in one verification pass (hf_bpd.limits)


def sparse_tree(widths: tuple[int, ...] | list[int]) -> list[tuple[int, ...]]:
    """Medusa-style tree choices: every rank path `(r_1, ..., r_d)` with `r_i < widths[i]`, for every depth d.

    `sparse_tree((3, 2, 1))` explores the top-3 tokens of head 1, the top-2 of head 2 after each of them, and the top-1
    of head 3: 3 + 6 + 6 = 15 nodes.
    """
    if not widths or any(int(w) < 1 for w in widths):
        raise BPDConfigError(f"tree widths must be a non-empty list of integers >= 1, got {list(widths)}")
    nodes = sum(math.prod(int(w) for w in widths[:depth]) for depth in range(1, len(widths) + 1))
    if nodes > MAX_TREE_NODES:
        raise BPDConfigError(f"tree widths {list(widths)} make {nodes} nodes, over the ceiling of {MAX_TREE_NODES} "
                             "tokens per verification: use smaller widths")
    choices = []
    for depth in range(1, len(widths) + 1):
        choices.extend(itertools.product(*(range(int(w)) for w in widths[:depth])))
    return choices


def validate_tree_choices(choices, num_heads: int) -> list[tuple[int, ...]]:
    """Check Medusa-style rank paths: non-empty tuples of ranks >= 0, no deeper than the heads, prefix-closed."""
    clean = [tuple(int(r) for r in c) for c in choices]
    if len(set(clean)) > MAX_TREE_NODES:
        raise BPDConfigError(f"the tree has {len(set(clean))} nodes, over the ceiling of {MAX_TREE_NODES}: prune it")
    if not clean:
        raise BPDConfigError("tree is empty: pass rank paths such as [(0,), (1,), (0, 0)] or hf_bpd.sparse_tree(...)")
    present = set(clean)
    for c in clean:
        if not c or any(r < 0 for r in c):
            raise BPDConfigError(f"bad tree path {c}: each path is a non-empty tuple of top-k ranks >= 0")
        if len(c) > num_heads:
            raise BPDConfigError(f"tree path {c} is deeper than the {num_heads} heads in use: shorten it")
        if len(c) > 1 and c[:-1] not in present:
            raise BPDConfigError(f"tree path {c} has no parent {c[:-1]} in the tree: add it")
    return sorted(present, key=lambda c: (len(c), c))


def parse_tree(tree, num_heads: int) -> list[tuple[int, ...]]:
    """The `tree` drafting option as rank paths: widths per head (`"4,2,2,1"` or `(4, 2, 2, 1)`, cut to the
    heads in use) or rank paths (`[(0,), (1,), (0, 0)]`)."""
    if isinstance(tree, str):
        try:
            widths = [int(w) for w in tree.replace(" ", "").split(",") if w]
        except ValueError:
            raise BPDConfigError(f"tree={tree!r}: pass comma-separated top-k widths per head, e.g. '4,2,2,1'") from None
        return sparse_tree(widths[:num_heads] if widths else widths)
    if isinstance(tree, (list, tuple)) and tree and all(isinstance(w, int) and not isinstance(w, bool) for w in tree):
        return sparse_tree(list(tree)[:num_heads])
    if not isinstance(tree, (list, tuple)) or not all(isinstance(c, (list, tuple)) for c in tree):
        raise BPDConfigError(f"tree must be widths per head ('4,2,2,1' or (4, 2, 2, 1)) or rank paths "
                             f"([(0,), (1,), (0, 0)]), got {tree!r}")
    if not all(isinstance(r, int) and not isinstance(r, bool) for c in tree for r in c):
        raise BPDConfigError(f"tree rank paths hold integer ranks, got {tree!r}")
    return validate_tree_choices(tree, num_heads)


class DraftTree:
    """A trie of draft token sequences below the root (the last decoded token).

    Node `i` (0-based, parents before children) has `tokens[i]`, `parents[i]` (-1 for the root's children) and
    `depths[i]` (1 for the root's children). `children[i]` maps token -> child node (`children[-1]`: root's).
    """

    def __init__(self, drafts):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.children: dict[int, dict[int, int]] = {-1: {}}
        for draft in drafts:
            node = -1
            for token in draft:
                token = int(token)
                child = self.children[node].get(token)
                if child is None:
                    child = len(self.tokens)
                    self.tokens.append(token)
                    self.parents.append(node)
                    self.depths.append(1 if node < 0 else self.depths[node] + 1)
                    self.children[node][token] = child
                    self.children[child] = {}
                node = child

    def __len__(self) -> int:
        return len(self.tokens)

    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children.values())

    def ancestors_mask(self) -> torch.Tensor:
        """`(n + 1, n + 1)` bool: row i may attend to column j (block positions; 0 is the root)."""
        n = len(self)
        allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        allowed[:, 0] = True
        for i in range(n):
            node = i
            while node >= 0:
                allowed[i + 1, node + 1] = True
                node = self.parents[node]
        return allowed

    def block_depths(self) -> torch.Tensor:
        """Depth of each block position: 0 for the root, then each node's depth."""
        return torch.tensor([0] + self.depths, dtype=torch.long)


def choose_token(scores: torch.Tensor, do_sample: bool) -> int:
    """The base's own choice from processed scores `(vocab,)`: argmax, or a sample of their softmax."""
    if do_sample:
        return int(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1))
    return int(scores.argmax(-1))


def _descend(tree: DraftTree, choose) -> tuple[list[int], list[int], int, list[int]]:
    """From the root, take `choose(block row, tokens so far)` at the current node's block row and move down while a
    child carries it: `(tokens, path, position, block rows of the tokens)` (see `walk`)."""
    node, position, path, tokens, visited = -1, 0, [], [], []
    while True:
        token = choose(position, tokens)
        tokens.append(token)
        visited.append(position)
        child = tree.children[node].get(token)
        if child is None:
            return tokens, path, position, visited
        node, position = child, child + 1
        path.append(child)


def walk(tree: DraftTree, block_logits: torch.Tensor, sequence: torch.Tensor, logits_processor, do_sample: bool):
    """Accept along `tree`: from the root, take the base's own (processed, greedy or sampled) choice at the current
    node's block position (`block_logits` `(q, vocab)`, `sequence` `(1, len)` the context before the block) and move
    down while a child carries it. Returns `(tokens, path, position, step_logits, step_scores)`: the decoded tokens
    (the accepted drafts plus the base's own next token), the accepted node indices, the block position of the last
    one (whose hidden state drafts next), and each token's raw and processed logits `(1, vocab)`."""
    step_logits, step_scores = [], []

    def choose(position: int, tokens: list[int]) -> int:
        context = torch.cat([sequence, torch.tensor([tokens], dtype=sequence.dtype, device=sequence.device)], dim=1)
        logits = block_logits[position][None]
        processed = logits_processor(context, logits.clone())
        step_logits.append(logits)
        step_scores.append(processed)
        return choose_token(processed[0], do_sample)

    tokens, path, position, _ = _descend(tree, choose)
    return tokens, path, position, step_logits, step_scores


class GreedyRows:
    """The base's greedy choice, and how close its runner-up came, at the rows of one verification block, for greedy
    decoding without logits processors (the scores are the raw logits): `walk_greedy` and the near-tie check read
    them instead of processing each row as `walk` does. On CPU the rows are read in place through NumPy (an argmax
    over a 49k vocabulary: ~2 us, against ~30 us for a torch call); elsewhere every row's choice and gap come in one
    transfer. Both pick the first of equal maxima, as `torch.argmax` does."""

    def __init__(self, logits: torch.Tensor):
        self.array = logits.numpy() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        if self.array is None:
            scores = logits.float()
            top = scores.topk(2, dim=-1).values
            self.best = scores.argmax(-1).tolist()
            self.tops = list(zip(top[:, 0].tolist(), (top[:, 0] - top[:, 1]).tolist()))

    def choice(self, row: int) -> int:
        return int(self.array[row].argmax()) if self.array is not None else self.best[row]

    def top(self, row: int, token: int) -> tuple[float, float]:
        """`(best score, best - second best)` of `row` whose best is `token`, in float32 as `topk` gives them."""
        if self.array is None:
            return self.tops[row]
        scores = self.array[row]
        best = scores[token]
        second = max(scores[:token].max() if token else -np.inf, scores[token + 1:].max()
                     if token + 1 < len(scores) else -np.inf)
        return float(best), float(best - np.float32(second))


def walk_greedy(tree: DraftTree, rows: GreedyRows) -> tuple[list[int], list[int], int, list[int]]:
    """`walk` for greedy decoding without logits processors: `(tokens, path, position, block rows of the tokens)`."""
    return _descend(tree, lambda position, tokens: rows.choice(position))


def tree_attention_masks(tree: DraftTree, cache, past_length: int, layer_types: list[str] | None,
                         sliding_window: int | None, dtype: torch.dtype, device) -> torch.Tensor | dict:
    """Additive 4D masks `(1, 1, q, kv)` for verifying `tree` on top of `cache` (holding `past_length` tokens).

    For a base with only full-attention layers this is one tensor; with sliding-window layers it is a dict
    `{"full_attention": ..., "sliding_attention": ...}` (the form transformers' hybrid models accept), each sized
    by the cache's own `get_mask_sizes` for that layer type.
    """
    q = len(tree) + 1
    allowed_block = tree.ancestors_mask().to(device)
    query_pos = past_length + tree.block_depths().to(device)
    types = layer_types or ["full_attention"]
    masks = {}
    for kind in dict.fromkeys(types):
        layer_idx = types.index(kind)
        kv_length, kv_offset = cache.get_mask_sizes(q, layer_idx)
        key_abs = kv_offset + torch.arange(kv_length, device=device)  # absolute cache slot of each key
        in_past = key_abs < past_length
        allowed = in_past[None, :].expand(q, kv_length).clone()
        block_cols = (~in_past).nonzero().flatten()
        allowed[:, block_cols] = allowed_block[:, key_abs[block_cols] - past_length]
        if kind == "sliding_attention" and sliding_window:
            key_pos = torch.where(in_past, key_abs, past_length + tree.block_depths().to(device)[
                (key_abs - past_length).clamp(min=0, max=q - 1)])
            allowed &= (query_pos[:, None] - key_pos[None, :]) < sliding_window
        elif kind not in ("full_attention", "sliding_attention"):
            raise BPDConfigError(f"tree verification does not support {kind!r} layers: use num_drafts=1 (chain)")
        mask = torch.zeros(q, kv_length, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        masks[kind] = mask[None, None]
    if set(masks) == {"full_attention"}:
        return masks["full_attention"]
    return masks


def keep_accepted(cache, block_length: int, keep: list[int]) -> None:
    """Keep only block positions `keep` (in order) of the last `block_length` cache entries of every layer."""
    order = keep + [i for i in range(block_length) if i not in set(keep)]
    if order != list(range(block_length)):
        for layer in cache.layers:
            if not hasattr(layer, "keys") or layer.keys is None:
                raise BPDConfigError(f"tree verification needs a DynamicCache with key/value layers, got "
                                     f"{type(layer).__name__}: use num_drafts=1 (chain)")
            if layer.keys.numel() == 0:
                continue
            idx = torch.tensor(order, device=layer.keys.device) + (layer.keys.shape[-2] - block_length)
            head = torch.arange(layer.keys.shape[-2] - block_length, device=layer.keys.device)
            full = torch.cat([head, idx])
            layer.keys = layer.keys.index_select(-2, full)
            layer.values = layer.values.index_select(-2, full)
    cache.crop(-(block_length - len(keep)))
