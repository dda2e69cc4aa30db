"""Near-ties: greedy choices too close for a faster kernel's rounding are decided by the base's own `generate()`.

A verification forward computes the same logits as plain decoding up to floating-point rounding: compiled kernels
(`compile=True`), and blocks of several tokens instead of one, add or multiply in another order. Where the base's
two best (processed) scores are closer than that rounding, the two computations can pick different tokens — measured
on SmolLM2: one position in 51,200 (two logits 5.7e-6 apart) where compiled verification and the eager greedy
`generate()` disagreed. Greedy decoding therefore checks the margin between the two best scores of every token it
decodes; where it is below `tie_margin` x max(1, |best score|), the `EagerReferee` computes that position exactly as
the base's eager `generate()` does and its choice is kept (a different choice ends the step there, like a rejected
draft).

The referee is the base's own `generate()`, forced along the decoded tokens: it owns a `DynamicCache` that it only
advances when asked, one token per forward pass as plain decoding does (the prompt in one pass), so its logits are
those of the reference `base.generate()` bit for bit, and the cost of all its calls together is at most one plain
eager decoding of the sequence — paid only up to the last near-tie.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicCache

from ..kv_cache import CACHE_NAME

# Default `tie_margin`, relative to max(1, |best score|), for an fp32 base. Measured on SmolLM2
# (`benchmarks/near_ties.py --rounding 6`, benchmarks/results/near_ties_rounding.json): compiled verification's logits
# are within 1.5e-5 of the eager generate()'s (relative, largest over the vocabulary and 984 positions), so a margin
# between two of them is off by at most ~3e-5; no eager margin there was below 1e-4, 7 (0.7 %) below 1e-3.
# Half-precision bases default to 0 (off): their rounding reaches ~1e-2, where near-ties are common enough that the
# referee would re-run most of plain decoding.
DEFAULT_TIE_MARGIN = 5e-5


def default_tie_margin(dtype: torch.dtype) -> float:
    return DEFAULT_TIE_MARGIN if dtype in (torch.float32, torch.float64) else 0.0


class _Follow(LogitsProcessor):
    """Makes `generate()` pick the given tokens, one per step (its raw logits are untouched)."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids, scores):
        if self.step < len(self.tokens):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.tokens[self.step]] = 0.0
            scores = forced
        self.step += 1
        return scores


class EagerReferee:
    """The base's eager greedy `generate()`, advanced on demand along one decoded sequence (see the module text)."""

    def __init__(self, base, prompt_length: int, margin: float):
        self.base, self.prompt_length, self.margin = base, prompt_length, margin
        self.cache = DynamicCache(config=base.config.get_text_config(decoder=True))
        self.checks = 0  # positions decided by the referee
        self.changed = 0  # of which the fast path's choice was different
        self.seconds = 0.0

    def logits(self, prefix: torch.LongTensor) -> torch.Tensor:
        """The raw next-token logits `(1, vocab)` (float32) after `prefix` `(1, length)`, as the base's eager
        `generate()` computes them when it decodes `prefix[:, prompt_length:]` from `prefix[:, :prompt_length]`."""
        start = time.perf_counter()
        cached = self.cache.get_seq_length()
        length = prefix.shape[1]
        if cached >= length:  # positions only grow within a call; start over if asked for an earlier one
            self.cache = DynamicCache(config=self.base.config.get_text_config(decoder=True))
            cached = 0
        # generate() feeds what the cache lacks: the whole prompt first, then one token per step
        fed = max(cached + 1, self.prompt_length)
        follow = prefix[0, fed:].tolist()
        out = self.base.generate(
            input_ids=prefix[:, :fed], attention_mask=torch.ones_like(prefix[:, :fed]), **{CACHE_NAME: self.cache},
            max_new_tokens=len(follow) + 1, do_sample=False, num_beams=1, use_cache=True,
            eos_token_id=None,  # the decoded tokens may hold an EOS (a call that does not stop at it): go on
            logits_processor=LogitsProcessorList([_Follow(follow)]), output_logits=True, return_dict_in_generate=True)
        if len(out.logits) != len(follow) + 1:
            raise RuntimeError(f"hf_bpd: the near-tie referee decoded {len(out.logits)} of {len(follow) + 1} tokens "
                               "(a stopping criterion of the base's generation config ended it): pass tie_margin=0")
        self.cache = out[CACHE_NAME]
        self.seconds += time.perf_counter() - start
        return out.logits[-1].float()

    def settle(self, sequence: torch.LongTensor, tokens: list[int], step_logits: list, step_scores: list,
               logits_processor, tops: list[tuple[float, float]] | None = None) -> int | None:
        """Check one step's decoded `tokens` (appended to `sequence` `(1, length)`), with their raw and processed
        logits `(1, vocab)`: every token whose two best processed scores are closer than `margin` x max(1, |best|) is
        re-decided from the referee's logits (which replace the step's for it). Returns the index of the first token
        the referee changed — the lists are cut after it — or None. `tops` gives each token's `(best score, best -
        second best)` when they are already known (`tree.GreedyRows`); the logits lists may then hold None."""
        for i, scores in enumerate(step_scores):
            if tops is not None:
                best, gap = tops[i]
            else:
                values = scores[0].topk(2).values
                best, gap = float(values[0]), float(values[0] - values[1])
            if gap >= self.margin * max(1.0, abs(best)):
                continue
            prefix = sequence if i == 0 else torch.cat(
                [sequence, torch.tensor([tokens[:i]], dtype=sequence.dtype, device=sequence.device)], dim=1)
            raw = self.logits(prefix).to(sequence.device)
            processed = logits_processor(prefix, raw.clone())
            token = int(processed[0].argmax(-1))
            self.checks += 1
            step_logits[i], step_scores[i] = raw, processed
            if token != tokens[i]:
                self.changed += 1
                tokens[i] = token
                del tokens[i + 1:], step_logits[i + 1:], step_scores[i + 1:]
                return i
        return None
