"""The runtime's one entry for the decoding algorithm: `hf_bpd.generation` imports from `hf_bpd.runtime` through this
module only. It asks for a verifier for a model, dtype and device (`compiled_verification`, `batch_runner`), what a
step costs (`CompiledVerification.costs`, `eager_costs_at`) and a heads step; which graphs exist, their shapes, the
machine checks and the kernels behind them stay in the other runtime modules."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

from .attention import grouped_query_attention, uses_grouped_attention
from .batched import batched_lock
from . import compiled
from .compiled import compiled_runner, discard_runners, head_top_k
from .compiled_verifier import CompiledVerifier
from .cost import eager_costs_at
from .frame_stack import on_fresh_frame_stack
from .int8_heads import int8_heads_step

__all__ = ["CompiledVerification", "batch_runner", "batched_lock", "cheap_block_length", "compiled_verification",
           "discard_compiled", "eager_costs_at", "eager_heads_step", "grouped_query_attention", "lone_prefill",
           "on_fresh_frame_stack", "smaller_batch_runner", "uses_grouped_attention"]


def cheap_block_length(model) -> int:
    """The longest block a compiled step verifies for about the price of one token (`COMPILED_DRAFT_SLOTS`): a
    drafter without a node budget of its own may fill it."""
    return 1 + compiled.COMPILED_DRAFT_SLOTS


@dataclass
class CompiledVerification:
    """What one call verifies with: `verifier` (`prefill`/`verify`/`keep`/`close`), the measured ms of a step of each
    block length it runs (`costs`), the lock the call holds while it decodes, what runs the steps (`kind`, for the
    call's stats), the seconds this call spent compiling, and the compiled heads step (None when not asked for)."""

    verifier: CompiledVerifier
    costs: dict[int, float]
    lock: object
    kind: str
    compile_seconds: float = 0.0
    heads_step: object = None


def compiled_verification(model, block_lengths: list[int], needed_length: int, device, attention_mask=None,
                          wait: bool = False, heads=None, top_k: int = 0, int8: bool | None = False
                          ) -> CompiledVerification | None:
    """The compiled verifier of one call whose blocks have `block_lengths` tokens and whose cache holds
    `needed_length`, warmed up (and timed) for those lengths, with a compiled heads step for `heads` at `top_k` when
    given; None when the call verifies eagerly (with a one-line warning when the compiled step cannot serve this base
    or call; silently while the base's step for this machine is being built in the background). With `wait`, a
    missing step is built here first. A compiler failure propagates after the base's compiled state is discarded."""
    start = time.perf_counter()
    found = _verifier(model, needed_length, attention_mask, wait)
    if found is None:
        return None
    verifier, runner = found
    built = time.perf_counter() - start if wait else 0.0
    try:
        top_k = head_top_k(top_k, model.config.draft_size) if heads is not None else 0
        before = sum(runner.compiled_buckets.values()) + sum(runner.compiled_heads.values())
        blocking = wait or runner.kind == "compiled"  # a prebuilt step compiles nothing unless asked
        runner.warm_up(block_lengths, device, heads, top_k, int8=int8, blocking=blocking)
        seconds = built + sum(runner.compiled_buckets.values()) + sum(runner.compiled_heads.values()) - before
        verifier.buckets = block_lengths
        step = runner.heads_step(heads, top_k, int8=int8, blocking=blocking) if heads is not None else None
    except Exception:
        discard_runners(model.base_lm)
        raise
    return CompiledVerification(verifier, {b: runner.bucket_ms[b] for b in block_lengths}, runner.lock, runner.kind,
                                seconds, step)


def discard_compiled(model) -> None:
    """Forget the base's compiled steps (after a failed compile: the next call starts afresh)."""
    discard_runners(model.base_lm)


def eager_heads_step(heads, top_k: int, draft_size: int, warn: bool = True):
    """The int8 heads kernel's step for an eager call, or None where it does not serve these heads (saying why once
    if `warn`)."""
    return int8_heads_step(heads, head_top_k(top_k, draft_size), warn=warn)


def _verifier(model, needed_length: int, attention_mask, wait: bool):
    """`(CompiledVerifier, runner)` for one call, or None (see `compiled_verification`). Bases the prebuilt steps
    cannot serve (and `HF_BPD_OFF=artifacts`) compile with `torch.compile`."""
    from . import artifacts, background
    from .compiled import ArtifactRunner
    from .step import compile_unsupported_reason

    base = model.base_lm
    reason = compile_unsupported_reason(base)
    if reason is None and attention_mask is not None:
        reason = "an attention mask was given"
    if reason is not None:
        warnings.warn(f"hf_bpd: compile=True is not used for this call ({reason}); decoding eagerly", stacklevel=5)
        return None
    artifact, log = None, lambda line: background.logger.warning("hf_bpd: %s", line)
    if artifacts.enabled() and artifacts.unsupported_reason(base) is None:
        if wait:
            artifact = artifacts.ensure(base, log=log)
        else:
            artifact = background.ready_artifact(base)
            # while it is built: eager verification, or for a base whose artifact is code only (position-ordered,
            # where only a compiled step is exact against its plain decoding) the step compiled in the call
            if artifact is None and not artifacts.supplies_constants(base):
                return None
    runner = compiled_runner(base, needed_length, artifact)
    if isinstance(runner, ArtifactRunner):
        runner.blocking = wait
    return CompiledVerifier(model, runner), runner


def batch_runner(base, rows: int, needed_length: int, wait: bool):
    """A compiled batched runner of `base` for `rows` rows holding `needed_length` tokens (`hf_bpd.runtime.batched`),
    or None (with a one-line warning) when batches of this base cannot run compiled. `compile=True` (not `wait`):
    the runner of the base's prebuilt steps, or None, silently, while they are being built in the background
    (`hf_bpd.runtime.background`; bases it cannot serve say why); its one-token and two-token batch steps run once
    they are built (their builds start with the first such batch)."""
    from . import artifacts, background
    from .batched import batched_artifact_unsupported_reason, batched_runner, batched_unsupported_reason

    reason, artifact = batched_unsupported_reason(base), None
    if reason is None and not wait:
        reason = batched_artifact_unsupported_reason(base, rows)
        if reason is not None:
            reason += ': compile="wait" compiles its batched steps in the call'
        else:
            artifact = background.ready_artifact(base)
            if artifact is None:  # being built in the background
                return None
    runner = batched_runner(base, rows, needed_length, artifact) if reason is None else None
    if runner is not None and artifact is not None:
        batch_steps = rows > 1 and artifacts.one_token_unsupported_reason(base) is None
        runner.one_token = background.ready_artifact(base, artifacts.ONE_TOKEN) if batch_steps else None
        # the two-token batch step, built after the one-token one (one build at a time per artifact)
        runner.two_tokens = background.ready_artifact(base, artifacts.TWO_TOKENS) if batch_steps else None
    if reason is None and runner is None:
        reason = f"a static cache of {rows} rows x {needed_length} tokens would be too large"
    if runner is None:
        warnings.warn(f"hf_bpd: the batch verifies eagerly ({reason})", stacklevel=5)
    return runner


def smaller_batch_runner(runner, rows: int):
    """The batched runner like `runner` (same base, cache length and prebuilt step) for `rows` rows, or None."""
    from .batched import batched_runner

    return batched_runner(runner.base, rows, runner.max_cache_len, runner.artifact)


def lone_prefill(model, needed_length: int):
    """`(runner, prefill)`: the base's single-sequence compiled runner and its prompt pass, `prefill(prompt) ->
    (logits, hidden)` (`CompiledVerifier.prefill`): a batch row's prompt pass on an ordered runner runs as a lone
    call's does."""
    single = compiled_runner(model.base_lm, needed_length)
    return single, lambda prompt: CompiledVerifier(model, single).prefill(prompt)
