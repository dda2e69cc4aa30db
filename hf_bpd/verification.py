"""Verify and accept (paper Alg. 1, stages 2-3).

Two loops, both entered through the standard `generate()` (as its `custom_generate` decoding method, after
transformers has prepared the generation config, logits processors, stopping criteria and cache):

* `chain_decoding`: one draft per step, verified by transformers' own `_assisted_decoding` with a
  `BlockDraftCandidateGenerator`;
* `tree_decoding`: several drafts per step (p-best drafts or a Medusa-style tree) verified together in one forward
  pass with a 4D tree attention mask over one KV cache.

Acceptance is exact in both: for greedy decoding a draft token is accepted iff it is the base's own (processed)
argmax; for sampling a token is drawn from the base's (processed) distribution at each tree node and accepted iff a
child carries it. Drafts are deterministic, so this is speculative sampling with a one-hot draft distribution: the
output distribution is the base model's.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerateDecoderOnlyOutput, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .drafting import BlockDraftCandidateGenerator, BlockDrafter, GenerationStats
from .errors import BPDConfigError
from .tree import DraftTree, keep_accepted, tree_attention_masks


@dataclass
class DecodingPlan:
    drafter: BlockDrafter
    stats: GenerationStats
    use_tree: bool
    streamer: BaseStreamer | None = None


class StopGuard:
    """Applies the stopping criteria at every prefix, not only at the end of an accepted block.

    transformers checks stopping criteria once per step; a block may run past a token at which plain decoding
    would have stopped (a stop string, a custom criterion). The guard finds the first such length so the output is
    cut exactly where plain decoding stops.
    """

    def __init__(self, criteria: StoppingCriteriaList, prompt_length: int):
        self.criteria = criteria
        self.checked = prompt_length
        self.stop_length: int | None = None

    def first_stop(self, sequence: torch.LongTensor) -> int | None:
        while self.stop_length is None and self.checked < sequence.shape[1]:
            self.checked += 1
            if bool(self.criteria(sequence[:, : self.checked], None).any()):
                self.stop_length = self.checked
        return self.stop_length


class _GuardCriteria(StoppingCriteria):
    def __init__(self, guard: StopGuard):
        self.guard = guard

    def __call__(self, input_ids, scores, **kwargs):
        stop = self.guard.first_stop(input_ids) is not None
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class _GuardStreamer(BaseStreamer):
    """Forwards the prompt, then only the tokens up to the guard's stop."""

    def __init__(self, streamer: BaseStreamer, guard: StopGuard):
        self.streamer, self.guard, self.sequence = streamer, guard, None

    def put(self, value):
        value = value.reshape(1, -1).cpu()
        if self.sequence is None:
            self.sequence = value
            self.streamer.put(value)
            return
        start = self.sequence.shape[1]
        self.sequence = torch.cat([self.sequence, value], dim=1)
        stop = self.guard.first_stop(self.sequence)
        end = self.sequence.shape[1] if stop is None else min(stop, self.sequence.shape[1])
        if end > start:
            self.streamer.put(self.sequence[0, start:end])

    def end(self):
        self.streamer.end()


def _truncate(result, stop_length: int | None, prompt_length: int):
    if stop_length is None:
        return result
    if isinstance(result, torch.Tensor):
        return result[:, :stop_length]
    result.sequences = result.sequences[:, :stop_length]
    for name in ("scores", "logits"):
        value = getattr(result, name, None)
        if value is not None:
            setattr(result, name, value[: stop_length - prompt_length])
    cache = getattr(result, "past_key_values", None)
    if cache is not None and cache.get_seq_length() > stop_length - 1:
        cache.crop(-(cache.get_seq_length() - (stop_length - 1)))
    return result


def check_supported(model, input_ids, generation_config, model_kwargs, use_tree: bool) -> None:
    """One-line errors for what drafting does not support."""
    if (generation_config.num_beams or 1) > 1:
        raise BPDConfigError("beam search cannot be combined with drafting heads: use num_beams=1 or use_heads=False")
    if input_ids.shape[0] != 1:
        raise BPDConfigError(f"drafting with heads decodes one sequence at a time, got a batch of {input_ids.shape[0]}:"
                             " loop over prompts, or pass use_heads=False for batched plain decoding")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise BPDConfigError("the attention mask pads a batch of one: drop the padding (tokenize without padding)")
    if generation_config.penalty_alpha or generation_config.dola_layers is not None:
        raise BPDConfigError("contrastive search / DoLa cannot be combined with drafting heads: pass use_heads=False")
    if generation_config.prompt_lookup_num_tokens is not None or generation_config.assistant_early_exit is not None \
            or getattr(generation_config, "use_mtp", False):
        raise BPDConfigError("another drafting method was requested (prompt lookup / early exit / MTP): pass "
                             "use_heads=False to use it instead of the heads")
    cache = model_kwargs.get("past_key_values")
    if generation_config.cache_implementation not in (None, "dynamic") or (
        cache is not None and not isinstance(cache, DynamicCache)
    ):
        raise BPDConfigError(f"drafting needs a dynamic KV cache, got "
                             f"{generation_config.cache_implementation or type(cache).__name__}: drop "
                             "cache_implementation / past_key_values, or pass use_heads=False")
    if not generation_config.use_cache:
        raise BPDConfigError("drafting needs use_cache=True")
    if use_tree and (generation_config.output_attentions or generation_config.output_hidden_states):
        raise BPDConfigError("output_attentions / output_hidden_states are not returned by multi-draft verification:"
                             " use num_drafts=1 without a tree")


def chain_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, plan: DecodingPlan,
                   **model_kwargs):
    """One draft per step through transformers' `_assisted_decoding` (greedy or sampling)."""
    check_supported(model, input_ids, generation_config, model_kwargs, use_tree=False)
    guard = StopGuard(stopping_criteria, input_ids.shape[1])
    streamer = _GuardStreamer(plan.streamer, guard) if plan.streamer is not None else None
    if streamer is not None:
        streamer.put(input_ids.cpu())
    model._bpd_candidate_generator = BlockDraftCandidateGenerator(plan.drafter, plan.stats,
                                                                  generation_config.max_length)
    try:
        result = GenerationMixin._assisted_decoding(
            model, input_ids, logits_processor=logits_processor,
            stopping_criteria=StoppingCriteriaList([_GuardCriteria(guard)]),
            generation_config=generation_config, streamer=streamer, **model_kwargs,
        )
    finally:
        model._bpd_candidate_generator = None
    return _truncate(result, guard.stop_length, input_ids.shape[1])


def _choose(scores: torch.Tensor, do_sample: bool) -> int:
    if do_sample:
        return int(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1))
    return int(scores.argmax(-1))


def tree_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, plan: DecodingPlan,
                  **model_kwargs):
    """Several drafts per step, verified together with tree attention over one KV cache."""
    check_supported(model, input_ids, generation_config, model_kwargs, use_tree=True)
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    cache.activate_past_recording()
    stats, drafter = plan.stats, plan.drafter
    do_sample = generation_config.do_sample
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores, raw_logits = [], []
    text_config = model.base_lm.config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None)
    sliding_window = getattr(text_config, "sliding_window", None)
    base_params = inspect.signature(model.base_lm.forward).parameters
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in base_params else {}

    guard = StopGuard(stopping_criteria, input_ids.shape[1])
    streamer = plan.streamer
    if streamer is not None:
        streamer.put(input_ids.cpu())
    sequence = input_ids

    def accept(tokens: list[int], step_logits: list[torch.Tensor], step_scores: list[torch.Tensor]) -> None:
        nonlocal sequence
        start = sequence.shape[1]
        new = torch.tensor([tokens], dtype=sequence.dtype, device=sequence.device)
        sequence = torch.cat([sequence, new], dim=1)
        stop = guard.first_stop(sequence)
        if stop is not None:
            sequence = sequence[:, :stop]
        kept = sequence.shape[1] - start
        scores.extend(step_scores[:kept])
        raw_logits.extend(step_logits[:kept])
        if streamer is not None and kept > 0:
            streamer.put(sequence[0, start:].cpu())

    # The prompt pass: decodes the first token and yields the hidden state the first block is drafted from.
    out = model(input_ids=input_ids, attention_mask=model_kwargs.get("attention_mask"), past_key_values=cache,
                use_cache=True, return_head_logits=False, **keep_last)
    logits = out.logits[:, -1].float()
    processed = logits_processor(input_ids, logits.clone())
    stats.accepted_lengths.append(0)
    stats.draft_tokens.append(0)
    hidden = out.last_hidden_state[0, -1]
    accept([_choose(processed[0], do_sample)], [logits], [processed])

    while guard.stop_length is None:
        start = time.perf_counter()
        room = generation_config.max_length - sequence.shape[1] - 1
        tree = DraftTree(drafter.drafts(hidden, sequence[0].tolist(), room))
        stats.draft_seconds += time.perf_counter() - start

        past = cache.get_seq_length()
        block = torch.tensor([[int(sequence[0, -1])] + tree.tokens], dtype=sequence.dtype, device=sequence.device)
        mask = tree_attention_masks(tree, cache, past, layer_types, sliding_window, model.base_lm.dtype,
                                    sequence.device)
        positions = (past + tree.block_depths()).to(sequence.device)[None]
        out = model(input_ids=block, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, return_head_logits=False)
        block_logits = out.logits[0].float()

        # Walk down the tree while the base's own choice is a child of the current node.
        node, position, path, step_logits, step_scores, tokens = -1, 0, [], [], [], []
        while True:
            context = torch.cat([sequence, torch.tensor([tokens], dtype=sequence.dtype,
                                                        device=sequence.device)], dim=1)
            logits = block_logits[position][None]
            processed = logits_processor(context, logits.clone())
            token = _choose(processed[0], do_sample)
            tokens.append(token)
            step_logits.append(logits)
            step_scores.append(processed)
            child = tree.children[node].get(token)
            if child is None:
                break
            node, position = child, child + 1
            path.append(child)

        keep_accepted(cache, len(tree) + 1, [0] + [c + 1 for c in path])
        hidden = out.last_hidden_state[0, position]
        stats.accepted_lengths.append(len(path))
        stats.draft_tokens.append(len(tree))
        accept(tokens, step_logits, step_scores)

    if streamer is not None:
        streamer.end()
    if cache.get_seq_length() > sequence.shape[1] - 1:
        cache.crop(-(cache.get_seq_length() - (sequence.shape[1] - 1)))
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=sequence,
            scores=tuple(scores) if keep_scores else None,
            logits=tuple(raw_logits) if keep_logits else None,
            past_key_values=cache,
        )
    return sequence
