"""The drafter contract, and block drafting with it (paper Alg. 1, stage 1): heads -> top-k lattice -> rescorer ->
draft(s)."""

from __future__ import annotations

import copy

import torch

from ..lattice import Lattice
from ..rescorers.base import HeadScoreRescorer, Rescorer
from .calibration import HeadCalibration, acceptance_rates
from .lookup import prompt_lookup


class Drafter:
    """What the decoding loops ask of a drafter, and all they ask (in the spirit of transformers'
    `CandidateGenerator`): propose drafts for the next verification within the draft nodes the caller asks for, and
    read what the base verified. The loops never branch on a drafter's type.

    `draft_nodes` is the one name for the node count: the draft tokens one verification holds (None: every token the
    drafter proposes)."""

    reads_features = False  # `start` gets every prompt position's feature, `observe` every verification's
    one_prompt = False  # decodes one unpadded prompt per call
    depth = 0  # tokens of its longest draft chain (0: it drafts nothing)
    fills_any_budget = False  # fills any number of draft nodes best-first (`set_draft_nodes`)
    draft_nodes: int | None = None

    def max_block_length(self) -> int:
        """The most tokens one verification can hold: the last token plus every draft node."""
        return 1

    def budgeted(self) -> bool:
        """A node budget is in effect: the drafter fills `draft_nodes` nodes best-first."""
        return self.draft_nodes is not None and self.fills_any_budget

    def set_draft_nodes(self, nodes: int | None, count=None) -> None:
        """Fill `nodes` draft nodes per verification (None: the call's own budget); `count(chances)`: how many of
        the likeliest nodes, given their chances of being accepted, to verify (None: all)."""

    def take_cheap_block(self, length: int) -> None:
        """The verifier runs blocks of up to `length` tokens for about the price of one: a drafter that would gain from
        more nodes than it was asked for may take them."""

    def heads_step_request(self):
        """`(heads, top_k)` of a heads step the runtime may run for this drafter (compiled, or an int8 kernel), or
        None."""
        return None

    def use_heads_step(self, step) -> None:
        """Draft with `step(hidden, next token) -> (top-k log-probabilities, indices)` of every head (None: eager)."""

    def for_row(self) -> Drafter:
        """This drafter for one row of a batch (its own state, nothing shared with the other rows)."""
        return copy.copy(self)

    def start(self, features: torch.Tensor, input_ids: torch.Tensor, first_token: int) -> None:
        """The prompt pass's features (every position's when `reads_features`), the prompt and its decoded token."""

    def drafts(self, hidden, context: list[int], max_length: int) -> tuple[list[tuple[int, ...]], list[float]]:
        """Draft token sequences (at most `max_length` tokens each) following `context`, best first, and the
        probabilities of the best draft's tokens (what `draft_schedule="cost"` weighs)."""
        return [], []

    def best_draft(self, hidden, context: list[int], max_length: int) -> tuple[int, ...]:
        """The draft this drafter would verify first (what a batch's probe scores)."""
        drafts = self.drafts(hidden, context, max_length)[0]
        return drafts[0] if drafts else ()

    def observe(self, block_hidden: torch.Tensor, kept: list[int], tokens: list[int]) -> None:
        """After a verification: the base's features at the kept block positions and the tokens that followed."""


class BlockDrafter(Drafter):
    """Drafts from one base hidden state with the first `num_heads` heads.

    Args:
        heads: the model's `DraftHeads`.
        num_heads: heads to use (block size = num_heads + 1).
        top_k: lattice width (candidates per head).
        num_drafts: drafts returned per step (p-best); 1 for chain decoding.
        rescorer: picks drafts from the lattice; `HeadScoreRescorer` (head scores only) by default.
        tree_choices: Medusa-style rank paths; when given, the drafts are those paths instead.
        prompt_lookup: also draft the context's own continuation of its last n-gram (`hf_bpd.generation.lookup`),
            verified with the heads' drafts in the same pass: one more path, as long as the heads' drafts, unless a
            node budget is in effect.
        draft_nodes: a budget of draft nodes per verification. The heads' drafts (their `num_drafts` best paths,
            each a chain of tokens) and the copy then compete for the budget best-first (`best_first_nodes`: the
            nodes likeliest to be accepted, from the calibrated head confidences, a path rank's measured discount and
            prompt lookup's measured acceptance rates), so every step verifies one block of `1 + draft_nodes` tokens.
            Without one, a chain with prompt lookup takes the verifier's cheap block (`take_cheap_block`).
        calibration: measured acceptance rates (`hf-bpd calibrate`; None: the defaults).
    """

    def __init__(self, heads, num_heads: int, top_k: int = 1, num_drafts: int = 1, rescorer: Rescorer | None = None,
                 tree_choices: list[tuple[int, ...]] | None = None, prompt_lookup: bool = False,
                 draft_nodes: int | None = None, calibration: HeadCalibration | None = None):
        self.heads = heads
        self.num_heads = self.depth = num_heads
        self.top_k = top_k
        self.num_drafts = num_drafts
        self.rescorer = rescorer or HeadScoreRescorer()
        self.tree_choices = tree_choices
        self.fills_any_budget = tree_choices is None
        self.prompt_lookup = prompt_lookup
        self.head_top = None  # (hidden, next token) -> (top-k log-probs, indices) of every head (`use_heads_step`)
        self.calibration = calibration
        self.node_count = None  # chances of the likeliest nodes -> how many to verify (`set_draft_nodes`)
        if draft_nodes is not None and not prompt_lookup:  # no more nodes than the paths hold (a compiled block
            draft_nodes = min(draft_nodes, num_heads * num_drafts)  # is padded to its budget)
        self.asked_nodes = self.draft_nodes = draft_nodes  # the call's budget; the one in effect
        if tree_choices:
            self.top_k = max(top_k, 1 + max(r for c in tree_choices for r in c))

    def max_block_length(self) -> int:
        if self.budgeted():
            return 1 + self.draft_nodes
        lookup = self.num_heads if self.prompt_lookup else 0
        if self.tree_choices is not None:
            return 1 + len(self.tree_choices) + lookup
        return 1 + self.num_heads * self.num_drafts + lookup

    def set_draft_nodes(self, nodes: int | None, count=None) -> None:
        self.draft_nodes = self.asked_nodes if nodes is None else nodes
        self.node_count = count

    def take_cheap_block(self, length: int) -> None:
        if self.draft_nodes is None and self.prompt_lookup and self.num_drafts == 1 and self.tree_choices is None:
            self.draft_nodes = max(length - 1, self.num_heads)  # the chain and the copy share the block

    def heads_step_request(self):
        return self.heads, self.top_k

    def use_heads_step(self, step) -> None:
        self.head_top = step

    def for_row(self) -> BlockDrafter:
        row = copy.copy(self)
        row.rescorer = self.rescorer.for_call()
        row.rescorer.reset()
        return row

    def best_draft(self, hidden, context: list[int], max_length: int) -> tuple[int, ...]:
        """The heads' best path as the rescorer ranks it (without the copy or a node budget)."""
        drafts = self.head_drafts(hidden, context, max_length)[0]
        return drafts[0] if drafts else ()

    @torch.no_grad()
    def lattice(self, hidden: torch.Tensor, num_heads: int | None = None, next_token: int | None = None) -> Lattice:
        """The top-k lattice of the heads from `hidden`; sequential (hydra) heads read `next_token` (the base's next
        token) and then each other's argmax, so their lattice is conditioned on the heads' greedy path."""
        logits = self.heads.step_logits(hidden, num_heads or self.num_heads, next_token)
        return Lattice.from_head_logits(logits, self.top_k, self.heads.to_vocab_ids)

    @torch.no_grad()
    def drafts(self, hidden: torch.Tensor, context: list[int], max_length: int
               ) -> tuple[list[tuple[int, ...]], list[float]]:
        """Draft token sequences (at most `max_length` tokens each) following `context`, best first (the prompt-lookup
        path, if any, last), and the heads' probabilities of the best draft's tokens (what `draft_schedule="cost"`
        weighs)."""
        drafts, probs = self.head_drafts(hidden, context, max_length)
        best = probs[0] if probs else []
        if self.budgeted() and drafts:  # every draft and the copy compete for the budget's nodes
            calibration = self.calibration or HeadCalibration.default()
            paths = [(d, [r * calibration.rank_factor(rank) for r in acceptance_rates(self.calibration, p)])
                     for rank, (d, p) in enumerate(zip(drafts, probs))]
            copied = prompt_lookup(context, min(self.draft_nodes, max_length)) if self.prompt_lookup else ()
            if copied:
                paths.append((copied, calibration.lookup_rates(len(copied))))
            return best_first_nodes(paths, self.draft_nodes, self.node_count), best
        if self.prompt_lookup and drafts:  # one more path
            copied = prompt_lookup(context, max(len(d) for d in drafts))
            if copied and not any(d[: len(copied)] == copied for d in drafts):
                drafts.append(copied)
        return drafts, best

    @torch.no_grad()
    def head_drafts(self, hidden: torch.Tensor, context: list[int], max_length: int
                    ) -> tuple[list[tuple[int, ...]], list[list[float]]]:
        """The heads' drafts (see `drafts`) and the heads' probabilities of each draft's tokens (for a tree: of the
        top-1 path's)."""
        n = min(self.num_heads, max_length)
        if n <= 0:
            return [], []
        plain = self.tree_choices is None and self.top_k == 1 and type(self.rescorer) is HeadScoreRescorer
        if self.head_top is not None:  # the compiled heads step (generate(compile=True))
            values, indices = self.head_top(hidden, context[-1])
            values, indices = values[:n, : self.top_k].cpu(), indices[:n, : self.top_k]
            if plain:
                return [tuple(self.heads.to_vocab_ids(indices[:, 0]).tolist())], [values[:, 0].exp().tolist()]
            lattice = Lattice(self.heads.to_vocab_ids(indices).cpu(), values)
        elif plain:  # Plain BPD: the argmax of each head, no lattice needed.
            best = torch.softmax(self.heads.step_logits(hidden, n, context[-1]).float(), dim=-1).max(-1)
            return [tuple(self.heads.to_vocab_ids(best.indices).tolist())], [best.values.tolist()]
        else:
            lattice = self.lattice(hidden, n, context[-1])
        if self.tree_choices is not None:
            drafts = [lattice.path_tokens(c) for c in self.tree_choices if len(c) <= n]
            return drafts, [lattice.logprobs[:, 0].exp().tolist()]  # the top-1 path's
        drafts = [d.tokens[:n] for d in self.rescorer.rescore(lattice, context, self.num_drafts)]
        return drafts, [lattice.token_probs(d) for d in drafts]


class NoDrafter(Drafter):
    """Drafts nothing: the decoding loop then takes one plain step per token (`use_heads=False, compile=True`)."""


def best_first_nodes(paths: list[tuple[tuple[int, ...], list[float]]], budget: int, count=None
                     ) -> list[tuple[int, ...]]:
    """At most `budget` draft nodes from several candidate chains, the likeliest to be accepted first.

    `paths` holds `(tokens, rates)`: a chain and each token's acceptance rate given the ones before it. A node (a
    prefix of a chain; chains sharing a prefix share its nodes) is worth the chance its whole prefix is accepted,
    the product of its rates (the best over the chains that hold it). The chance falls along every chain, so the
    `budget` most likely nodes form prefixes: they are returned as one draft per chain (its chosen prefix), ties
    going to the earlier chain. This is how prompt lookup's copy competes with the heads' chain for the same
    verification slots. `count(chances)`, given the chances of the `budget` likeliest nodes in order, may take fewer
    (`controller.CostSchedule.choose_nodes`: `draft_schedule="cost"`).
    """
    value: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    for rank, (tokens, rates) in enumerate(paths):
        chance = 1.0
        for j in range(len(tokens)):
            chance *= rates[j]
            node = tuple(tokens[: j + 1])
            if chance > value.get(node, -1.0):
                value[node] = chance
            order.setdefault(node, rank)
    chosen = sorted(value, key=lambda node: (-value[node], order[node], len(node)))[: max(budget, 0)]
    if count is not None:
        chosen = chosen[: count([value[node] for node in chosen])]
    keep = set(chosen)
    # every chosen node's prefixes are chosen too (their chance is at least as large; ties resolved by length)
    leaves = [node for node in chosen if not any(other[: len(node)] == node and other != node for other in keep)]
    return sorted(leaves, key=lambda node: order[node])
