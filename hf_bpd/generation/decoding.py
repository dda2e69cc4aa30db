"""The decoding loop (paper Alg. 1): draft, verify, accept, for every drafting shape.

`blockwise_decoding` is the one route: `BlockwiseParallelForCausalLM.generate()` hands it to transformers' public
`generate(custom_generate=...)`, which first prepares the generation config, logits processors, stopping criteria
and KV cache exactly as for plain decoding. Each step then

1. drafts from the hidden state that produced the last token (`BlockDrafter`: heads -> lattice -> rescorer),
2. verifies every draft in one base forward pass: the drafts form a `DraftTree` (a chain is a tree with one branch,
   verified with the ordinary causal mask; a wider tree gets a 4D tree-attention mask),
3. accepts the longest path whose every token is the base's own choice, and rolls the KV cache back to it.

Acceptance is exact: for greedy decoding a draft token is accepted iff it is the base's own (processed) argmax; for
sampling a token is drawn from the base's (processed) distribution at each tree node and accepted iff a child
carries it. Drafts are deterministic, so this is speculative sampling with a one-hot draft distribution: the output
distribution is the base model's.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.streamers import BaseStreamer

from ..errors import BPDConfigError, BPDTypeError, InputError, WorkLimitError
from ..kv_cache import CACHE_NAME
from ..limits import MAX_COST_SCHEDULE_BLOCK
from ..rescorers.base import HeadScoreRescorer
from ..rescorers.registry import resolve_rescorer
from ..runtime import execution
from .batch import decode_batch
from .calibration import HeadCalibration
from .config import MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, MAX_NUM_DRAFTS, SCHEDULES, DraftingOptions, _int_value
from .controller import CostSchedule, StepSwitch, eager_costs
from .drafting import BlockDrafter, Drafter, NoDrafter
from .feature_drafting import FeatureChainDrafter
from .near_ties import EagerReferee, default_tie_margin
from .stats import BlockwiseGenerateOutput, GenerationStats
from .stopping import DecodedSequence
from .tree import DraftTree, GreedyRows, choose_token, parse_tree, walk, walk_greedy
from .verify import EagerVerifier


@dataclass
class DecodingPlan:
    """Everything one `generate()` call drafts with; it lives for that call only (nothing is stored on the model)."""

    drafter: Drafter
    stats: GenerationStats
    calibration: HeadCalibration | None = None  # the heads' measured acceptance rates (`hf-bpd calibrate`)
    streamer: BaseStreamer | None = None
    compile: bool | str = False  # verify with the compiled step on a static cache (`runtime.execution`);
    # "wait": build / compile it in the call if need be (else eager verification while it builds in the background)
    schedule: str = "fixed"  # "cost": verify only the drafted tokens that pay (`hf_bpd.generation.controller`)
    tie_margin: float | None = None  # greedy near-ties decided by the base's eager generate() (`near_ties`)
    heads_int8: bool | None = None  # the heads step with int8 weights on CPU (`int8_heads`; None: when compiled)
    row_drafts: bool = False  # batches: each row drafts with `drafter` as asked (drafting options given in the call),
    # not the batched heads chains at a cost-aware width (`hf_bpd.generation.batch`)


def max_positions(base) -> int | None:
    """The most positions the base model's config allows (`max_position_embeddings`, GPT-2's `n_positions`), or
    None when it names no limit."""
    text = base.config.get_text_config()
    for field in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _length_option(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BPDTypeError(f"{name} must be an integer >= 1, got {value!r} ({type(value).__name__}): pass e.g. "
                           f"{name}=128")
    return value


def check_inputs(model, input_ids, generation_config, kwargs: dict) -> None:
    """One-line `InputError`s for `generate()` inputs, before any forward pass: the prompt's type, shape and token
    ids, and the requested length against the base's positions (prompt + max_new_tokens, else max_length)."""
    if kwargs.get("inputs_embeds") is not None:
        raise BPDConfigError("inputs_embeds: drafting reads token ids: pass input_ids, or generate from embeddings "
                             "with model.base_lm.generate(inputs_embeds=...)")
    if input_ids is None:
        return  # BOS-only generation: transformers checks it
    if not isinstance(input_ids, torch.Tensor):
        raise BPDTypeError(f"input_ids must be a torch.LongTensor of shape (batch, length), got "
                           f"{type(input_ids).__name__}: tokenize with return_tensors='pt'")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise BPDTypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}: pass "
                           "input_ids.long()")
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}: add a batch "
                         "dimension with input_ids[None]")
    if input_ids.shape[1] == 0:
        raise InputError(f"the prompt is empty (input_ids of shape {tuple(input_ids.shape)}): pass at least one "
                         "token, e.g. the tokenizer's BOS token")
    if input_ids.shape[0] == 0:
        raise InputError("input_ids holds no sequence (batch of 0): pass at least one prompt")
    vocab = model.base_lm.config.get_text_config().vocab_size
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        raise InputError(f"input_ids holds token id {bad}, outside the base model's vocabulary [0, {vocab}): "
                         "tokenize with the base model's own tokenizer")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) != tuple(input_ids.shape):
        raise InputError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(input_ids.shape)}: "
                         "pass the mask the tokenizer returned with these ids")
    config = generation_config if generation_config is not None else model.generation_config
    prompt = input_ids.shape[1]
    # transformers' precedence: max_new_tokens (per call, else the config's unless max_length is passed), else
    # max_length
    new = kwargs.get("max_new_tokens", None if "max_length" in kwargs else config.max_new_tokens)
    if new is not None:
        new = _length_option("max_new_tokens", new)
        if new < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {new}")
        total, asked = prompt + new, f"the prompt ({prompt} tokens) + max_new_tokens ({new})"
        fix = "lower max_new_tokens to {room}"
    else:
        length = _length_option("max_length", kwargs.get("max_length", config.max_length))
        total, asked = length, f"max_length ({length})"
        fix = "lower max_length to {limit} (or pass max_new_tokens <= {room})"
    limit = max_positions(model.base_lm)
    if limit is not None and total > limit:
        room = limit - prompt
        if room < 1:
            raise InputError(f"the prompt ({prompt} tokens) fills the base model's {limit} positions "
                             "(max_position_embeddings): shorten the prompt")
        raise InputError(f"{asked} = {total} tokens exceeds the base model's {limit} positions "
                         f"(max_position_embeddings): " + fix.format(room=room, limit=limit) + " or shorten the "
                         "prompt")


def plan_feature_drafting(model, options: DraftingOptions) -> DecodingPlan:
    """`drafter="feature"`: the checkpoint's feature-level drafter drafts (`FeatureChainDrafter`)."""
    drafter = model.feature_drafter
    if drafter is None:
        raise BPDConfigError("drafter='feature' needs a feature-level drafter: load a checkpoint that has one "
                             "(a feature_drafter/ folder) or call model.load_feature_drafter(folder)")
    if drafter.layers_read() != [-1]:
        raise BPDConfigError(f"this feature-level drafter fuses base layers {drafter.layers_read()[1:]} with the "
                             "final feature; generate() drafts with final-feature drafters only: load one trained "
                             "with --feature-layers none")
    base = model.base_lm
    drafter.to(device=base.device, dtype=base.dtype)
    method = "feature-chain" + ("+lookup" if options.prompt_lookup else "")
    return DecodingPlan(drafter=FeatureChainDrafter(drafter, options.draft_depth or 4, options.prompt_lookup),
                        stats=GenerationStats(method=method))


def plan_drafting(model, options: DraftingOptions) -> DecodingPlan:
    """Validate the drafting options of one call (one-line `BPDConfigError`s) and build its drafter."""
    if not isinstance(options.prompt_lookup, bool):
        raise BPDTypeError(f"prompt_lookup must be True or False, got {options.prompt_lookup!r}")
    if options.drafter == "feature":
        return plan_feature_drafting(model, options)
    config = model.config
    n = config.num_heads if options.num_heads_to_use is None else options.num_heads_to_use
    n = _int_value("num_heads_to_use", n, 1, config.num_heads)
    vocab = config.draft_size
    num_drafts = _int_value("num_drafts", options.num_drafts, 1, MAX_NUM_DRAFTS)
    if options.tree is None and num_drafts * n > MAX_DRAFT_NODES:
        raise WorkLimitError(f"num_drafts x heads = {num_drafts} x {n} = {num_drafts * n} draft tokens per "
                             f"verification, over the ceiling of {MAX_DRAFT_NODES}: pass num_drafts <= "
                             f"{MAX_DRAFT_NODES // n} (or fewer num_heads_to_use)")
    rescorer = resolve_rescorer(options.rescorer, model.bundled_rescorers, model)
    choices = None if options.tree is None else parse_tree(options.tree, n)
    plain = num_drafts == 1 and isinstance(rescorer, HeadScoreRescorer) and choices is None
    top_k = options.draft_top_k
    if top_k is None:
        top_k = 1 if plain else min(16, vocab)
    top_k = _int_value("draft_top_k", top_k, 1, min(MAX_DRAFT_TOP_K, vocab))
    if choices is not None:
        widest, limit = 1 + max(r for c in choices for r in c), min(MAX_DRAFT_TOP_K, vocab)
        if widest > limit:
            why = f"the {vocab}-token draft vocabulary" if vocab < MAX_DRAFT_TOP_K else "the lattice width ceiling"
            raise BPDConfigError(f"tree ranks reach {widest - 1}, but ranks must be < {limit} ({why}): use smaller "
                                 "ranks")
    if options.draft_schedule not in SCHEDULES:
        raise BPDConfigError(f"draft_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got "
                             f"{options.draft_schedule!r}")
    rescorer.check_compatible(model)
    if choices is None and not plain:
        rescorer.check_work(n, top_k, num_drafts)
    rescorer = rescorer.for_call()  # this call's own rescorer state (nothing shared with concurrent calls)
    rescorer.reset()
    method = "tree" if choices is not None else ("p-best" if num_drafts > 1 else "chain")
    method += "+lookup" if options.prompt_lookup else ""
    method += f"/{options.draft_nodes} nodes" if options.draft_nodes is not None and choices is None else ""
    calibration = HeadCalibration.from_dict(getattr(config, "head_calibration", None))
    drafter = BlockDrafter(model.heads, n, top_k, num_drafts, rescorer, choices, options.prompt_lookup,
                           options.draft_nodes, calibration)
    schedule = options.draft_schedule
    if schedule == "cost" and drafter.max_block_length() > MAX_COST_SCHEDULE_BLOCK:  # wherever "cost" came from
        source = "" if "draft_schedule" in options.explicit else " (the model's generation config)"
        raise WorkLimitError(f"draft_schedule='cost'{source} weighs blocks of up to {MAX_COST_SCHEDULE_BLOCK} tokens, "
                             f"this plan verifies up to {drafter.max_block_length()}: use fewer drafts (num_drafts, "
                             "tree) or pass draft_schedule='fixed'")
    return DecodingPlan(drafter=drafter, stats=GenerationStats(method=method), schedule=schedule,
                        calibration=calibration)


def plan_plain() -> DecodingPlan:
    """Plain decoding through the same loop (one token per step): how `use_heads=False, compile=True` runs."""
    return DecodingPlan(drafter=NoDrafter(), stats=GenerationStats(method="plain-compiled"))


# the drafting options that, set by a call to another value than the model's, make each row of a batch draft as they
# say (`DecodingPlan.row_drafts`)
ROW_DRAFTING_OPTIONS = ("rescorer", "num_drafts", "tree", "draft_top_k", "prompt_lookup", "draft_nodes",
                        "draft_schedule")


def plan_call(model, options: DraftingOptions, kwargs: dict) -> DecodingPlan:
    """The plan of one `generate()` call: drafting (or plain decoding, compiled), with the call's streamer."""
    plan = plan_drafting(model, options) if options.use_heads else plan_plain()
    plan.compile = options.compile
    plan.tie_margin = options.tie_margin
    plan.heads_int8 = options.heads_int8
    plan.row_drafts = bool(set(options.changed) & set(ROW_DRAFTING_OPTIONS))
    plan.streamer = kwargs.pop("streamer", None)
    return plan


def call_option(kwargs: dict, generation_config, model_config):
    """`option(name)`: a `generate()` call's value of generation option or argument `name` (the call's `kwargs`',
    else `generation_config`'s, else `model_config`'s; None when none sets it)."""
    def option(name):
        if name in kwargs:
            return kwargs[name]
        for config in (generation_config, model_config):
            if config is not None and getattr(config, name, None) is not None:
                return getattr(config, name)
        return None

    return option


def transformers_only(option) -> tuple[str, str] | None:
    """`(option, one-line error)` for the first thing a `generate()` call asks for that only transformers' own
    decoding loop runs (beam search, contrastive search, DoLa, assisted decoding, another `custom_generate`, no or a
    non-dynamic or filled cache, attentions or hidden states per token), or None. `option(name)`: the call's value of
    a generation option or argument (`call_option`). With the heads each is an error; with `use_heads=False` such a
    call runs the base's own `generate()`."""
    if (option("num_beams") or 1) > 1:
        return "num_beams", "beam search cannot be combined with drafting heads: use num_beams=1 or use_heads=False"
    if option("penalty_alpha") or option("dola_layers") is not None:
        return "penalty_alpha", "contrastive search / DoLa cannot be combined with drafting heads: pass use_heads=False"
    if option("prompt_lookup_num_tokens") is not None or option("assistant_early_exit") is not None \
            or option("use_mtp"):
        return "prompt_lookup_num_tokens", ("another drafting method was requested (prompt lookup / early exit / "
                                            "MTP): pass use_heads=False to use it instead of the heads, or "
                                            "prompt_lookup=True to add prompt lookup's path to the heads' drafts")
    for name in ("assistant_model", "custom_generate"):  # call arguments only (no generation config holds them)
        if option(name) is not None:
            return name, f"{name} replaces the drafting loop: pass use_heads=False with it"
    implementation, cache = option("cache_implementation"), option(CACHE_NAME)
    if implementation not in (None, "dynamic") or (cache is not None and not isinstance(cache, DynamicCache)):
        got = implementation or type(cache).__name__
        return "cache_implementation", (f"drafting needs a dynamic KV cache, got {got}: drop cache_implementation / "
                                        f"{CACHE_NAME}, or pass use_heads=False")
    if cache is not None and cache.get_seq_length() > 0:
        return CACHE_NAME, f"drafting starts from an empty KV cache: drop {CACHE_NAME}, or pass use_heads=False"
    if option("use_cache") is False:
        return "use_cache", "drafting needs use_cache=True: drop use_cache=False, or pass use_heads=False"
    if option("output_attentions") or option("output_hidden_states"):
        return "output_attentions", ("output_attentions / output_hidden_states are not returned with drafting heads (a "
                                     "verification pass covers several tokens): pass use_heads=False to get them")
    return None


def check_supported(generation_config, model_kwargs) -> None:
    """One-line errors for what drafting does not support (`transformers_only`, on the resolved generation config)."""
    found = transformers_only(call_option(model_kwargs, generation_config, None))
    if found is not None:
        raise BPDConfigError(found[1])


@torch.no_grad()
def blockwise_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, *,
                       plan: DecodingPlan, **model_kwargs):
    """The `custom_generate` decoding method: draft, verify, accept until a stopping criterion holds. It runs on a
    frame-stack chunk of its own (`execution.on_fresh_frame_stack`): a step's speed does not depend on the caller's
    stack depth."""
    return execution.on_fresh_frame_stack(_blockwise_decoding, model, input_ids, logits_processor, stopping_criteria,
                                          generation_config, plan=plan, **model_kwargs)


def _blockwise_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, *,
                        plan: DecodingPlan, **model_kwargs):
    check_supported(generation_config, model_kwargs)
    mask = model_kwargs.get("attention_mask")
    padded = mask is not None and not bool(mask.all())
    drafter = plan.drafter
    if drafter.one_prompt and (input_ids.shape[0] > 1 or padded):
        raise BPDConfigError(f"drafter='feature' decodes one prompt at a time, without padding, got "
                             f"{input_ids.shape[0]}{' padded' if padded else ''}: pass one prompt per call, tokenized "
                             "without padding, or drafter='heads' for batches")
    if input_ids.shape[0] > 1 or padded:  # a batch (or a padded prompt): ragged rows on one cache (`.batch`)
        plan.stats.method += "+batch"
        return decode_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, plan, mask)
    compiled = None
    if plan.compile:
        try:
            # One compiled shape per drafting plan (its largest block); "cost" and "switch" also compile the
            # one-token step, "cost" a block about half as long too. The heads' lattice comes from a heads step.
            drafter.take_cheap_block(execution.cheap_block_length(model))
            largest = drafter.max_block_length()
            buckets = sorted({1, largest} if plan.schedule in ("cost", "switch") else {largest})
            if plan.schedule == "cost" and largest > 2:
                buckets = sorted({*buckets, 1 + (largest - 1) // 2})
            heads, top_k = drafter.heads_step_request() or (None, 0)
            # the last step's block is padded to `largest` tokens past the sequence's end: the cache holds them too
            compiled = execution.compiled_verification(
                model, buckets, generation_config.max_length + largest, input_ids.device,
                model_kwargs.get("attention_mask"), plan.compile == "wait", heads, top_k, plan.heads_int8)
            if compiled is not None:
                plan.stats.compile_seconds, plan.stats.verifier = compiled.compile_seconds, compiled.kind
                if compiled.heads_step is not None:
                    drafter.use_heads_step(compiled.heads_step)
        except Exception as err:  # noqa: BLE001 - a failing compiler must not break generation
            warnings.warn(f"hf_bpd: compiling failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                          "decoding eagerly", stacklevel=3)
            execution.discard_compiled(model)
            compiled = None
            drafter.set_draft_nodes(None)
            drafter.use_heads_step(None)
    if compiled is None:
        verifier = EagerVerifier(model, model_kwargs.get(CACHE_NAME), model_kwargs.get("attention_mask"))
        request = drafter.heads_step_request() if plan.heads_int8 else None
        if request is not None:  # asked for eagerly too
            drafter.use_heads_step(execution.eager_heads_step(*request, model.config.draft_size))
    else:
        verifier = compiled.verifier
    cost_schedule = None
    if plan.schedule == "cost" and drafter.max_block_length() > 1:
        costs = compiled.costs if compiled is not None else eager_costs(model.base_lm, drafter.max_block_length())
        cost_schedule = CostSchedule(costs, plan.calibration)
    switch = None
    if plan.schedule == "switch" and drafter.max_block_length() > 1:
        plain_ms = compiled.costs.get(1) if compiled is not None else None
        switch = StepSwitch(plain_ms if plain_ms else eager_costs(model.base_lm, 1)[1])
    with compiled.lock if compiled is not None else contextlib.nullcontext():
        return _decode(model, verifier, input_ids, logits_processor, stopping_criteria, generation_config, plan,
                       cost_schedule, switch)


def _within(drafts: list[tuple[int, ...]], depth: int) -> list[tuple[int, ...]]:
    """The drafts cut to their first `depth` tokens (duplicates dropped)."""
    return list(dict.fromkeys(d[:depth] for d in drafts if depth > 0))


def _decode(model, verifier, input_ids, logits_processor, stopping_criteria, generation_config, plan,
            cost_schedule=None, switch=None):
    stats, drafter, streamer = plan.stats, plan.drafter, plan.streamer
    nodes_weighed = cost_schedule is not None and drafter.budgeted()
    if nodes_weighed:  # a node budget: the drafter verifies the likeliest nodes that pay (`choose_nodes`)
        drafter.set_draft_nodes(drafter.draft_nodes, count=lambda chances: cost_schedule.choose_nodes(
            chances, overhead_ms=1000 * stats.draft_seconds / len(stats.accepted_lengths)))
    if isinstance(streamer, (list, tuple)):  # one streamer per row (batches); a batch of one
        if len(streamer) != 1:
            raise BPDConfigError(f"{len(streamer)} streamers for 1 prompt: pass one streamer per prompt")
        streamer = streamer[0]
    do_sample = generation_config.do_sample
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    decoded = DecodedSequence(input_ids, stopping_criteria, keep_scores, keep_logits, streamer)
    margin = default_tie_margin(model.base_lm.dtype) if plan.tie_margin is None else plan.tie_margin
    referee = EagerReferee(model.base_lm, input_ids.shape[1], margin) if margin > 0 and not do_sample else None
    # Greedy without logits processors, scores or logits to return: the block's raw logits decide directly.
    plain_greedy = not do_sample and len(logits_processor) == 0 and not keep_scores and not keep_logits

    # The prompt pass decodes the first token and gives the hidden state the first block is drafted from.
    if drafter.reads_features:
        logits, features = verifier.prefill(input_ids, all_positions=True)
        hidden = features[-1]
    else:
        logits, hidden = verifier.prefill(input_ids)
        features = hidden[None]
    logits = logits.float()
    processed = logits_processor(input_ids, logits.clone())
    stats.accepted_lengths.append(0)
    stats.draft_tokens.append(0)
    tokens, step_logits, step_scores = [choose_token(processed[0], do_sample)], [logits], [processed]
    if referee is not None:
        referee.settle(input_ids, tokens, step_logits, step_scores, logits_processor)
    decoded.accept(tokens, step_logits, step_scores)
    drafter.start(features, input_ids, tokens[0])

    while not decoded.stopped:
        start = time.perf_counter()
        sequence = decoded.sequence
        room = generation_config.max_length - sequence.shape[1] - 1
        if switch is None or switch.drafting:
            drafts, probs = drafter.drafts(hidden, decoded.tokens, room)
        else:  # a plain step (`controller.StepSwitch`), now and then drafting without verifying
            drafts, probs = [], []
            if switch.probe_due():
                switch.start_probe(drafter.drafts(hidden, decoded.tokens, room)[0], len(decoded.tokens))
        stats.draft_probs.append(probs)
        if cost_schedule is not None and drafts and not nodes_weighed:
            steps = len(stats.accepted_lengths)
            depth = cost_schedule.choose(probs, overhead_ms=1000 * stats.draft_seconds / steps,
                                  block_cost=lambda k: 1 + len({d[:j] for d in drafts for j in range(1, k + 1)}))
            drafts = _within(drafts, depth)
        tree = DraftTree(drafts)
        drafting = time.perf_counter() - start
        stats.draft_seconds += drafting

        block_logits, block_hidden = verifier.verify(int(sequence[0, -1]), tree, sequence.device)
        stats.verifier_steps[verifier.kind] = stats.verifier_steps.get(verifier.kind, 0) + 1
        block_logits = block_logits.float()

        # Walk down the tree while the base's own choice is a child of the current node.
        tops = None
        if plain_greedy:  # the raw logits decide: read the choices in place (`GreedyRows`)
            rows = GreedyRows(block_logits)
            tokens, path, position, visited = walk_greedy(tree, rows)
            step_logits, step_scores = [None] * len(tokens), [None] * len(tokens)
            if referee is not None:
                tops = [rows.top(row, token) for row, token in zip(visited, tokens)]
        else:
            tokens, path, position, step_logits, step_scores = walk(tree, block_logits, sequence, logits_processor,
                                                                    do_sample)
        if referee is not None:  # a near-tie the referee decided otherwise ends the step there, like a rejection
            cut = referee.settle(sequence, tokens, step_logits, step_scores, logits_processor, tops)
            if cut is not None and cut < len(path):
                path = path[:cut]
                position = path[-1] + 1 if path else 0
        kept = [0] + [c + 1 for c in path]
        verifier.keep(len(tree) + 1, kept)
        hidden = block_hidden[position]
        drafter.observe(block_hidden, kept, tokens)
        stats.accepted_lengths.append(len(path))
        stats.draft_tokens.append(len(tree))
        decoded.accept(tokens, step_logits, step_scores)
        if switch is not None:
            switch.record(len(tree) > 0, len(path) + 1, time.perf_counter() - start, decoded.tokens, drafting)

    sequence = decoded.sequence
    cache = verifier.close(sequence.shape[1], sequence)
    stats.reused_prompt_tokens = verifier.reused
    if switch is not None:
        stats.plain_steps = sum(1 for n in stats.draft_tokens[1:] if n == 0)
    if referee is not None:
        stats.tie_checks, stats.tie_changes, stats.tie_seconds = referee.checks, referee.changed, referee.seconds
    if generation_config.return_dict_in_generate:
        return BlockwiseGenerateOutput(
            sequences=sequence,
            scores=tuple(decoded.scores) if keep_scores else None,
            logits=tuple(decoded.logits) if keep_logits else None,
            **{CACHE_NAME: cache},
            generation_stats=stats,
        )
    return sequence
