"""What a `generate()` call did: `GenerationStats`, on `model.last_generation_stats` and on the output object."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.generation import GenerateDecoderOnlyOutput


@dataclass
class GenerationStats:
    """What one `generate()` call did. `model.last_generation_stats` holds the latest.

    `serial_calls` counts every base forward pass of the call, the one over the prompt included (it decodes the
    first token), so plain decoding has `block_efficiency == 1.0` exactly. `accepted_lengths[i]` is the number of
    draft tokens accepted by serial call `i` (0 for the prompt pass); each call also decodes one token of its own,
    so `block_efficiency == new_tokens / serial_calls == 1 + mean(accepted_lengths)` (the paper's definition).
    """

    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)  # tokens sent to verification per call (tree nodes)
    draft_probs: list[list[float]] = field(default_factory=list)  # heads' probabilities of each step's best draft
    draft_seconds: float = 0.0
    total_seconds: float = 0.0
    method: str = "chain"
    # Seconds this call waited for compilation: 0 with `compile=True` once the step for this machine is built (while
    # it is being built in the background the call verifies eagerly); with `compile="wait"`, building in the call.
    compile_seconds: float = 0.0
    # What ran the verification forwards, as the runtime names it (`CompiledVerification.kind`: a step built once
    # per machine by `hf-bpd compile`, or "compiled" by `torch.compile` in this process), or "eager";
    # `verifier_steps` counts the steps each ran (a prebuilt step serves blocks of up to 16 tokens: a longer block
    # runs eagerly on the same cache unless `compile="wait"`).
    verifier: str = "eager"
    verifier_steps: dict[str, int] = field(default_factory=dict)
    # `draft_schedule="switch"`: the steps that decoded one plain token because drafting was not paying
    plain_steps: int = 0
    # Compiled: prompt tokens whose keys/values the static cache still held from the previous call (not recomputed)
    reused_prompt_tokens: int = 0
    # Greedy near-ties (`hf_bpd.generation.near_ties`): positions the base's eager generate() decided, how many of
    # them it decided differently from the verification pass, and the seconds it took.
    tie_checks: int = 0
    tie_changes: int = 0
    tie_seconds: float = 0.0
    # A batch of prompts: each row's own statistics, and the base forward passes the batch shared. The batch's
    # `accepted_lengths` / `draft_tokens` are the rows' together, so its block efficiency is the rows' pooled one.
    rows: list[GenerationStats] | None = None
    forward_passes: int | None = None

    @property
    def serial_calls(self) -> int:
        return len(self.accepted_lengths)

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.serial_calls if self.serial_calls else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean draft tokens accepted per verification call (the prompt pass excluded)."""
        steps = self.accepted_lengths[1:]
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def verify_seconds(self) -> float:
        """Time outside drafting: base forward passes, acceptance and bookkeeping."""
        return max(self.total_seconds - self.draft_seconds, 0.0)

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "new_tokens": self.new_tokens,
            "serial_calls": self.serial_calls,
            "block_efficiency": self.block_efficiency,
            "mean_accepted": self.mean_accepted,
            "accepted_lengths": list(self.accepted_lengths),
            "draft_tokens": list(self.draft_tokens),
            "draft_probs": [list(p) for p in self.draft_probs],
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "compile_seconds": self.compile_seconds,
            "verifier": self.verifier,
            "verifier_steps": dict(self.verifier_steps),
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "plain_steps": self.plain_steps,
            "tie_checks": self.tie_checks,
            "tie_changes": self.tie_changes,
            "tie_seconds": self.tie_seconds,
            **({"forward_passes": self.forward_passes, "rows": [row.as_dict() for row in self.rows]}
               if self.rows is not None else {}),
        }


@dataclass
class BlockwiseGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' `GenerateDecoderOnlyOutput` (`return_dict_in_generate=True`) plus `generation_stats`."""

    generation_stats: GenerationStats | None = None


def finish_stats(stats: GenerationStats, result, prompt, start: float):
    """Complete a call's `stats` (new tokens, total seconds since `start`) and return `generate()`'s result, a dict
    output carrying them as `generation_stats`."""
    import time

    import torch

    sequences = result if isinstance(result, torch.Tensor) else result.sequences
    prompt_length = prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 else 0
    if stats.rows is None:  # a batch's rows counted their own new tokens
        stats.new_tokens = sequences.shape[1] - prompt_length
    if stats.method == "plain":
        stats.accepted_lengths = [0] * stats.new_tokens
    stats.total_seconds = time.perf_counter() - start
    if isinstance(result, GenerateDecoderOnlyOutput) and not isinstance(result, BlockwiseGenerateOutput):
        result = BlockwiseGenerateOutput(**result, generation_stats=stats)
    return result
