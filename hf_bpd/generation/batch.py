"""Drafting for a batch of prompts in one `generate()` call: every row drafts, is verified and accepts on its own.

Rows accept different numbers of tokens per step, so the batch's rows cannot stay aligned the way plain batched
decoding keeps them: they share one cache in which each row's tokens occupy some slots, in order, with holes where
it kept fewer tokens than another row (`hf_bpd.generation.batch_cache`). Each row's positions count only its own
tokens, so rotary embeddings see every row as if it were alone, and a step's 4D mask per row opens its valid slots
and its tree's ancestors. The prompt pass runs eagerly over the left-padded batch. The steps run the eager base on a
`DynamicCache` (finished rows leave it), or a compiled batched step on a static cache (`execution.batch_runner`):
with `compile=True` an fp32 base's step built once per machine (nothing compiled in the call; eagerly while it is
being built; finished rows leave its steps at once), with `compile="wait"` steps compiled per shape in the call
(finished rows ride along until the rest fit a smaller runner), also for a bf16 / int8-weight base on hf_bpd's
kernels (whose prompts then run one by one, each as a lone call's compiled prompt pass).

Drafts: the heads run once per step for every row (the int8 heads kernel's multi-row call, `_rows_heads_step`), then
each row drafts as the checkpoint's defaults say (its own rescorer state: rescored p-best paths and prompt lookup's
copy competing best-first) into the step's node budget; drafters without a budget (fixed sparse trees, sequential
heads) draft the heads' argmax chain. How many nodes the rows verify is decided per step by `controller.BatchWidth`
from the machine's forward costs and the rows' running acceptance: a block only as wide as pays, and plain one-token
steps (nothing drafted) when drafting does not pay; compiled, the widths are charged the compiled steps' own
timings. Drafting options a call sets to other values than the model's (`DecodingPlan.row_drafts`) make each row
draft as they say instead, every drafted token verified. Streaming: one streamer per row (`streamer=[...]`), each
fed its row's prompt and accepted tokens and ended when the row stops.

Each row is decoded exactly as transformers' batched plain `generate()` decodes it: logits processors and stopping
criteria see the row's left-padded context, as they do there (processors built for the whole batch read the row's
own padding length, prompt or index: `_row_processors`); for prompts without padding-sensitive processors
(a repetition penalty sees pad tokens there too) that is the prompt's own output. Floating-point sums over a padded
batch differ from a lone sequence's in the last bits, so a near-tie between the base's two best tokens can go either
way, as it can for transformers' batched decoding (`tests/test_batch.py` allows exactly that).
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (EncoderNoRepeatNGramLogitsProcessor,
                                                    EncoderRepetitionPenaltyLogitsProcessor,
                                                    PrefixConstrainedLogitsProcessor,
                                                    SynthIDTextWatermarkLogitsProcessor,
                                                    UnbatchedClassifierFreeGuidanceLogitsProcessor)

from ..errors import BPDConfigError
from ..kv_cache import CACHE_NAME
from ..runtime import execution
from .batch_cache import RaggedCache, StaticRaggedCache
from .controller import BatchWidth, eager_costs, shadow_accepted
from .stats import BlockwiseGenerateOutput, GenerationStats
from .stopping import DecodedSequence
from .tree import DraftTree, GreedyRows, choose_token, walk, walk_greedy


class _Row(DecodedSequence):
    """One prompt of the batch: its left-padded context growing as it decodes, its drafter and statistics."""

    def __init__(self, index: int, prompt: torch.Tensor, pad: int, drafter, criteria, stats: GenerationStats,
                 keep_scores: bool, keep_logits: bool, streamer=None):
        super().__init__(prompt[None], criteria, keep_scores, keep_logits, streamer, pad)
        self.index, self.drafter, self.stats = index, drafter, stats
        self.hidden = None


def _block_masks(trees: list[DraftTree], ragged: RaggedCache, width: int, dtype, layer_types, sliding_window):
    """`(positions (rows, Q), additive masks)` for one verification: row r's block sits at positions counted from
    its own tokens, sees its valid slots and its tree's ancestors; padding positions see only themselves."""
    rows, past, device = len(trees), ragged.length, ragged.valid.device
    allowed = torch.zeros(rows, width, past + width, dtype=torch.bool, device=device)
    allowed[:, :, :past] = ragged.valid[:, None, :]
    depths = torch.arange(width, device=device).repeat(rows, 1)
    for r, tree in enumerate(trees):
        q = len(tree) + 1
        allowed[r, :q, past: past + q] = tree.ancestors_mask().to(device)
        depths[r, :q] = tree.block_depths().to(device)
        pad = torch.arange(q, width, device=device)
        allowed[r, pad, past + pad] = True
    types = set(layer_types or ["full_attention"])
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise BPDConfigError(f"batched drafting does not support {sorted(unknown)} layers: pass use_heads=False")
    positions = ragged.counts()[:, None] + depths
    masks = {}
    for kind in types:
        kind_allowed = allowed
        if kind == "sliding_attention" and sliding_window:
            key_pos = torch.cat([ragged.valid.long().cumsum(-1) - 1, positions], dim=1)  # each key's, in its row
            kind_allowed = allowed & ((positions[:, :, None] - key_pos[:, None, :]) < sliding_window)
        mask = torch.zeros(rows, 1, width, past + width, dtype=dtype, device=device)
        mask.masked_fill_(~kind_allowed[:, None], torch.finfo(dtype).min)
        masks[kind] = mask
    return positions, (masks["full_attention"] if set(masks) == {"full_attention"} else masks)


def _rows_heads_step(model, drafter, int8):
    """The int8 heads kernel's step for every row of a step in one call (`Int8HeadsStep.rows`: each weight read once
    for all rows), resolved once per call, or None when it does not serve these heads here (`heads_int8=False`, not
    on a CPU, ...)."""
    request = drafter.heads_step_request() if int8 is not False else None
    if request is None:
        return None
    return execution.eager_heads_step(*request, model.config.draft_size, warn=int8 is True)


def _budgeted(drafter) -> bool:
    """Whether a row's drafter can fill any node budget best-first (its paths and prompt lookup's copy competing
    for the block, `BlockDrafter.drafts`): heads drafters without a fixed sparse tree."""
    return drafter.fills_any_budget


def _step_trees(model, plan, active: list[_Row], policy: BatchWidth, shadows: dict, num_heads: int,
                generation_config, computed=None, heads_step=None) -> list[DraftTree]:
    """One step's draft trees at the width `policy` chooses: each row's drafts in `width - 1` nodes (its drafter's
    paths, rescored over the first `width - 1` heads, the depths the step verifies, and prompt lookup's copy best-first;
    a chain of the heads' argmax tokens for drafters that cannot take a budget), or no drafts (a plain step; when a
    probe is due, shadow drafts are kept for the `PROBE_ROWS` rows probed longest ago: each one's best path as its
    drafter rescores it, or the heads' argmax chain for drafters that cannot take a budget). The heads run once for the
    rows drafted (`heads_step`, the int8 kernel's `_rows_heads_step`, when given: `(log-probabilities, draft-vocabulary
    indices)`, `(rows, heads, top_k)` each). A probe's shadow drafts stand for what a drafted step would verify (the
    heads' argmax chains are accepted less often than the drafter's paths, and would hold back widths that pay).
    Probing every row of a large batch costs a sizeable share of a plain step, so a probe drafts a few rows, in
    turn."""
    left = [generation_config.max_length - row.sequence.shape[1] for row in active]  # the step's token included
    width = policy.choose([row.index for row in active], left, computed)
    chains, drafting_ms, budgeted = None, None, _budgeted(plan.drafter)
    trees = [DraftTree([]) for _ in active]
    drafted = list(range(len(active))) if width > 1 else []  # positions in `active` of the rows drafted now
    if width == 1 and policy.max_width > 1 and policy.probe_due():
        # a probe drafts the rows probed longest ago (`BatchWidth.probe_rows`) whose last shadow draft is scored
        waiting = {row.index: r for r, row in enumerate(active) if row.index not in shadows}
        drafted = [waiting[i] for i in policy.probe_rows(list(waiting))]
    if drafted:
        start = time.perf_counter()
        hidden = torch.stack([active[r].hidden for r in drafted])
        # a drafted step verifies `width - 1` depths: only their heads run (a probe's shadow chains read every head)
        tops = None if heads_step is None else heads_step.rows(hidden, width - 1 if width > 1 else None)
        if width > 1 and budgeted:
            for k, r in enumerate(drafted):
                row = active[r]
                if left[r] <= 1:
                    continue
                row.drafter.set_draft_nodes(width - 1)
                if tops is not None:  # this row's share of the heads call
                    row.drafter.use_heads_step(lambda hidden, token, v=tops[0][k], i=tops[1][k]: (v, i))
                trees[r] = DraftTree(row.drafter.drafts(row.hidden, row.tokens, min(left[r], width) - 1)[0])
        elif width == 1 and budgeted:  # a probe: each row's best path as its drafter rescores it (see below)
            chains = {}
            for k, r in enumerate(drafted):
                row = active[r]
                if tops is not None:
                    row.drafter.use_heads_step(lambda hidden, token, v=tops[0][k], i=tops[1][k]: (v, i))
                chains[r] = list(row.drafter.best_draft(row.hidden, row.tokens, num_heads))
        else:
            if tops is not None:
                rows_chains = model.heads.to_vocab_ids(tops[1][:, :num_heads, 0]).tolist()
            else:
                rows_chains = batch_chains(model.heads, hidden, num_heads)
            if rows_chains is None:  # sequential heads: each row's own drafter, its best draft
                rows_chains = [list((active[r].drafter.drafts(active[r].hidden, active[r].tokens, num_heads)[0]
                                     or [()])[0]) for r in drafted]
            chains = dict(zip(drafted, rows_chains))
        drafting_ms = 1000 * (time.perf_counter() - start)
    policy.stepped(width, drafting_ms, max(len(drafted), 1))
    for r, row in enumerate(active):
        room = left[r] - 1
        if width > 1 and not budgeted and room > 0:
            trees[r] = DraftTree([tuple(chains[r][: min(width - 1, room)])])
        elif width == 1 and chains is not None and r in chains:
            shadows[row.index] = (list(chains[r]), len(row.tokens))
        row.stats.draft_probs.append([])
    return trees


@torch.no_grad()
def batch_chains(heads, hidden: torch.Tensor, num_heads: int) -> list[list[int]] | None:
    """Every row's draft chain (the heads' argmax tokens) from the rows' hidden states `(rows, hidden_size)`, in one
    batched heads call (a tied output projection read once for all heads and rows); None for sequential heads (each
    reads the previous head's token: drafted per row)."""
    if heads.sequential or num_heads <= 0:
        return None
    dtype = hidden.dtype
    states = [heads.heads[i](hidden.to(next(heads.parameters()).dtype)).to(dtype) for i in range(num_heads)]
    if heads.heads[0].projection is None:  # one product for every head
        logits = heads.project(0, torch.stack(states))
    else:
        logits = torch.stack([heads.project(i, state) for i, state in enumerate(states)])
    return heads.to_vocab_ids(logits.argmax(-1)).T.tolist()  # (rows, heads)


def _row_processors(logits_processor, row: int):
    """The call's logits processors as row `row` of the batch sees them: the ones holding something per row of the
    batch (the repetition penalty's padding lengths, the encoder penalties' prompts, the prefix constraint's row
    index, the SynthID watermark's state, classifier-free guidance's unconditional sequence) get the row's own."""
    out = LogitsProcessorList()
    for processor in logits_processor:
        if isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row: row + 1]
        elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
            processor = copy.copy(processor)
            processor.encoder_input_ids = processor.encoder_input_ids[row: row + 1]
        elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
            processor = copy.copy(processor)
            processor.generated_ngrams, processor.batch_size = [processor.generated_ngrams[row]], 1
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            processor = copy.copy(processor)
            allowed = processor._prefix_allowed_tokens_fn
            processor._prefix_allowed_tokens_fn = lambda batch_id, sent: allowed(row, sent)
        elif isinstance(processor, SynthIDTextWatermarkLogitsProcessor):  # its state: the contexts it has seen
            processor = copy.copy(processor)
            processor.state = None
        elif isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor):  # its unconditional sequences
            processor = copy.copy(processor)
            processor.unconditional_context = {key: value[row: row + 1] if isinstance(value, torch.Tensor) else value
                                               for key, value in processor.unconditional_context.items()}
        out.append(processor)
    return out


def _prompt_pass(model, input_ids, mask, runner, needed_length: int):
    """`(cache, last logits (rows, vocab), last hidden states (rows, hidden_size))` of the prompt pass: one eager
    forward over the left-padded batch (a row's positions count its own tokens), its cache moved onto `runner`'s
    static cache when there is one; on an ordered (bf16) runner each prompt alone, as a lone call runs it."""
    from transformers.cache_utils import DynamicCache

    if runner is not None and runner.ordered:
        return StaticRaggedCache.prefilled(runner, model, input_ids, mask.bool(), needed_length)
    cache = DynamicCache()  # full-length layers for every layer type: the masks bound sliding windows
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **{CACHE_NAME: cache},
                use_cache=True, return_head_logits=False, logits_to_keep=1)
    ragged = RaggedCache(cache, mask.bool())
    if runner is not None:
        ragged = StaticRaggedCache(runner, cache, ragged.valid)
    return ragged, out.logits[:, -1], out.last_hidden_state[:, -1]


def decode_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, plan, attention_mask):
    """Decode every row of `input_ids` (left-padded, `attention_mask` marking the padding) with drafting; returns
    what transformers' batched `generate()` returns (rows that stop early are right-padded with the pad token)."""
    streamers = plan.streamer
    if streamers is not None and (not isinstance(streamers, (list, tuple)) or len(streamers) != input_ids.shape[0]):
        raise BPDConfigError(f"a batch of {input_ids.shape[0]} prompts streams to one streamer per row "
                             "(transformers' streamers take one sequence): pass streamer=[one per prompt]")
    base = model.base_lm
    text_config = base.config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None)
    sliding_window = getattr(text_config, "sliding_window", None)
    do_sample = generation_config.do_sample
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    plain_greedy = not do_sample and len(logits_processor) == 0 and not keep_scores and not keep_logits
    device, batch = input_ids.device, input_ids.shape[0]
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if bool((mask[:, -1] == 0).any()):
        raise BPDConfigError("batched drafting needs left padding: tokenize with padding_side='left'")
    pads = (mask == 0).sum(-1).tolist()

    stats = plan.stats
    stats.rows = []
    rows = []
    for r in range(batch):
        drafter = plan.drafter.for_row()
        row_stats = GenerationStats(method=stats.method)
        stats.rows.append(row_stats)
        rows.append(_Row(r, input_ids[r], pads[r], drafter, stopping_criteria, row_stats, keep_scores, keep_logits,
                         streamers[r] if streamers is not None else None))

    with contextlib.ExitStack() as held:  # a compiled batch holds its runners' lock until it ends
        runner, needed = None, generation_config.max_length + plan.drafter.depth + 1
        if plan.compile and not plan.row_drafts:
            held.enter_context(execution.batched_lock())
            runner = execution.batch_runner(base, batch, needed, plan.compile == "wait")
        ragged, logits, hidden = _prompt_pass(model, input_ids, mask, runner, needed)
        stats.verifier = ragged.runner.kind if isinstance(ragged, StaticRaggedCache) else "eager"
        logits = logits.float()
        for r, row in enumerate(rows):
            row.processors = _row_processors(logits_processor, r)
            processed = row.processors(row.sequence, logits[r: r + 1].clone())
            row.stats.accepted_lengths.append(0)
            row.stats.draft_tokens.append(0)
            row.hidden = hidden[r]
            row.accept([choose_token(processed[0], do_sample)], [logits[r: r + 1]], [processed])
        forward_passes = 1

        active = [row for row in rows if not row.stopped]
        ragged.select(torch.tensor([row.index for row in active], dtype=torch.long, device=device))
        num_heads = plan.drafter.depth  # 0: plain steps (`use_heads=False`)
        policy, heads_step = None, None
        if not plan.row_drafts:
            heads_step = _rows_heads_step(model, plan.drafter, plan.heads_int8) if num_heads else None
            # the widest block: as many nodes as the heads' chain (each width is a compiled shape of its own; a
            # batch step's cost grows with rows x width, so wider blocks have not paid)
            # the costs: a prebuilt step's runner times its own steps (the eager forward's table misjudges them)
            costs = ragged.measured_costs(num_heads + 1) if num_heads else {}
            policy = BatchWidth(costs if 1 in costs else eager_costs(base, len(active) * (num_heads + 1)),
                                num_heads + 1, batch)
            for n, ms in sorted(ragged.step_costs().items()):  # compiled steps, timed when they compiled
                policy.costs.timing(n, ms)
            if num_heads:
                drafts = stats.method.split("/")[0].removesuffix("+batch") if _budgeted(plan.drafter) else "chain"
                stats.method = f"{drafts}/cost-aware+batch"
            for row in rows:
                row.stats.method = stats.method
        shadows: dict[int, tuple[list[int], int]] = {}  # row -> (shadow draft, tokens decoded when it was drafted)
        while active:
            start = time.perf_counter()
            if policy is None:  # each row's drafter, every draft verified
                trees = []
                for row in active:
                    room = generation_config.max_length - row.sequence.shape[1] - 1
                    drafts, probs = row.drafter.drafts(row.hidden, row.tokens, room)
                    row.stats.draft_probs.append(probs)
                    trees.append(DraftTree(drafts))
            else:
                trees = _step_trees(model, plan, active, policy, shadows, num_heads, generation_config,
                                    ragged.rows_computed, heads_step)
            stats.draft_seconds += time.perf_counter() - start
            width = max(len(t) for t in trees) + 1
            tokens = torch.zeros(len(active), width, dtype=torch.long, device=device)
            for r, (row, tree) in enumerate(zip(active, trees)):
                tokens[r, : len(tree) + 1] = torch.tensor([int(row.sequence[0, -1])] + tree.tokens)
            forward_start = time.perf_counter()
            ragged.make_room(width)
            positions, masks = _block_masks(trees, ragged, width, base.dtype, layer_types, sliding_window)
            block_logits, block_hidden, compiled = ragged.forward(model, tokens, positions, masks)
            block_logits = block_logits.float()

            kept_slots, gained = [], 0
            for r, (row, tree) in enumerate(zip(active, trees)):
                if plain_greedy:  # the raw logits decide: the block's greedy choices read in place
                    new, path, position, _ = walk_greedy(tree, GreedyRows(block_logits[r]))
                    step_logits = step_scores = []
                else:
                    new, path, position, step_logits, step_scores = walk(tree, block_logits[r], row.sequence,
                                                                         row.processors, do_sample)
                kept_slots.append([0] + [c + 1 for c in path])
                row.hidden = block_hidden[r, position]
                row.stats.accepted_lengths.append(len(path))
                gained += len(new)
                row.stats.draft_tokens.append(len(tree))
                row.accept(new, step_logits, step_scores)
                if policy is not None:
                    if len(tree):
                        policy.record(row.index, max(tree.depths), len(path))  # the depths it drafted
                    shadow = shadows.get(row.index)
                    if shadow is not None and (len(row.tokens) - shadow[1] >= len(shadow[0]) or row.stopped):
                        del shadows[row.index]
                        policy.record(row.index, *shadow_accepted(shadow[0], row.tokens[shadow[1]:]))
            ragged.keep_tail(width, kept_slots)
            if policy is not None:
                if compiled:  # this step compiled its shape: its time is the runner's timing of the step
                    stats.compile_seconds += ragged.runner.compiled_widths[width]
                    step_ms = ragged.runner.width_ms[width]
                else:
                    step_ms = 1000 * (time.perf_counter() - forward_start)
                policy.costs.timing(ragged.step_rows * width, step_ms)
                policy.delivered(width, gained / len(active), step_ms)
            forward_passes += 1
            still = [r for r, row in enumerate(active) if not row.stopped]
            if len(still) < len(active):
                ragged.select(torch.tensor(still, dtype=torch.long, device=device))
                active = [active[r] for r in still]

    for row in rows:
        row.stats.new_tokens = row.sequence.shape[1] - input_ids.shape[1]
        row.stats.total_seconds = float("nan")  # rows share every forward pass: time is the batch's
    stats.new_tokens = sum(row.stats.new_tokens for row in rows)
    stats.accepted_lengths = [n for row in rows for n in row.stats.accepted_lengths]
    stats.draft_tokens = [n for row in rows for n in row.stats.draft_tokens]
    stats.draft_probs = [p for row in rows for p in row.stats.draft_probs]
    stats.forward_passes = forward_passes
    pad_id = generation_config._pad_token_tensor
    pad_id = int(pad_id.flatten()[0]) if pad_id is not None else (generation_config.pad_token_id or 0)
    length = max(row.sequence.shape[1] for row in rows)
    sequences = torch.full((batch, length), pad_id, dtype=input_ids.dtype, device=device)
    for r, row in enumerate(rows):
        sequences[r, : row.sequence.shape[1]] = row.sequence[0]
    if not generation_config.return_dict_in_generate:
        return sequences

    def per_step(lists):  # transformers' layout: one (batch, vocab) tensor per new-token index
        steps = max(len(x) for x in lists)
        vocab = next(x[0].shape[-1] for x in lists if x)
        filler = torch.full((1, vocab), float("-inf"), device=device)
        return tuple(torch.cat([x[t] if t < len(x) else filler for x in lists], dim=0) for t in range(steps))

    return BlockwiseGenerateOutput(
        sequences=sequences,
        scores=per_step([row.scores for row in rows]) if keep_scores else None,
        logits=per_step([row.logits for row in rows]) if keep_logits else None,
        **{CACHE_NAME: None},  # the batch's cache holds holes and finished rows are gone: not reusable
        generation_stats=stats,
    )
