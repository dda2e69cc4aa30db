"""Compiled batches (`generate(..., compile="wait")` on several prompts, `hf_bpd.runtime.batched`): every row equals
the base's own `generate()` for that prompt alone (greedy, token for token up to the near-ties any padded batch
has, see `tests/test_batch.py`), with rows accepting different lengths in the same step, holes compacted on the
static cache, finished rows riding along and then moving to a runner of fewer rows; plain compiled batches
(`use_heads=False`) likewise; the eager fallbacks say why in one line."""

import copy
import warnings

import pytest
import torch

from hf_bpd.generation import batch as batch_module
from hf_bpd.generation.batch_cache import StaticRaggedCache
from hf_bpd.generation.drafting import BlockDrafter
from hf_bpd.runtime import batched
from hf_bpd.runtime.kernels import kernels_unsupported_reason
from tests.conftest import VOCAB
from tests.test_batch import PAD, check_rows, left_padded, random_prompts
from tests.test_decoding import random_bpd


def reference_drafts(monkeypatch, model, prompts, width, kwargs, branching=None, lone=None) -> dict:
    """Flat forced costs (every step drafts the widest block) and every row drafting its lone greedy continuation
    (in the step's node budget, or as `batch_chains`' chain), corrupted at a depth that depends on the row and step,
    so rows accept 0..all drafted tokens in the same step (a random tiny model's heads accept little). Returns the
    lone continuations. While `branching["on"]` (a dict the caller may flip between calls), rows draft into the node
    budget, and in every other step a row's budget holds a wrong one-token draft first and its continuation after it:
    the tree branches at its root, and a row that accepts keeps block slots that are not a prefix of its block.
    `lone`: the continuations to draft from, by row, when not the base's eager `generate()`."""
    if lone is None:
        lone = {r: model.base_lm.generate(p[None], **kwargs)[0, len(p):].tolist() for r, p in enumerate(prompts)}
    current = {"chains": [], "by_drafter": {}, "step": 0}
    branching = branching if branching is not None else {"on": False}
    original = batch_module._step_trees

    def step_trees(model_, plan, active, policy, shadows, num_heads, generation_config, computed=None, heads_step=None):
        step = len(active[0].stats.accepted_lengths)
        drafts = []
        for row in active:
            done = row.sequence.shape[1] - width
            truth = lone[row.index][done: done + num_heads] + [3] * num_heads
            wrong = (step * 3 + row.index) % (num_heads + 2)
            if wrong < num_heads:
                truth[wrong] = (truth[wrong] + 1) % VOCAB
            drafts.append(truth[:num_heads])
        current["chains"], current["step"] = drafts, step
        current["by_drafter"] = {id(row.drafter): (row.index, chain) for row, chain in zip(active, drafts)}
        return original(model_, plan, active, policy, shadows, num_heads, generation_config, computed, None)

    def row_drafts(drafter, hidden, context, max_length):  # a row's drafts in its node budget
        index, chain = current["by_drafter"][id(drafter)]
        chain = tuple(chain[: min(drafter.draft_nodes, max_length)])
        if branching["on"] and len(chain) >= 2 and (current["step"] + index) % 2 == 0:
            return [((chain[0] + 1) % VOCAB,), chain[:-1]], []  # the decoy first, the continuation second
        return [chain], []

    monkeypatch.setattr(batch_module, "batch_chains", lambda heads, hidden, n: [list(c) for c in current["chains"]])
    monkeypatch.setattr(BlockDrafter, "drafts", row_drafts)
    monkeypatch.setattr(batch_module, "_step_trees", step_trees)
    monkeypatch.setattr(batch_module, "_budgeted", lambda drafter: branching["on"])
    monkeypatch.setattr(batch_module, "eager_costs", lambda base, max_tokens: {1: 1e6, 4096: 1e6})
    monkeypatch.setattr(StaticRaggedCache, "measured_costs", lambda self, max_width: {})  # the flat costs rule
    monkeypatch.setattr("hf_bpd.generation.controller.TIMING_WEIGHT", 0.0)
    return lone


def test_compiled_batch_rows_equal_their_lone_output(monkeypatch):
    """Every step drafts (forced costs) the rows' corrupted lone continuations, in trees that branch at their root
    in every other step; a small cache is compacted mid-decoding; rows stop at their own EOS, ride along, then move
    to a runner of fewer rows (drafting chains)."""
    model = random_bpd("llama", 0)
    prompts = random_prompts(6, seed=5, longest=20)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    branching = {"on": True}
    lone = reference_drafts(monkeypatch, model, prompts, width, kwargs, branching)
    monkeypatch.setattr(batched, "CACHE_BUCKET", 1)  # a cache just as long as the call: holes force compaction
    compactions, compact = [], StaticRaggedCache.compact
    monkeypatch.setattr(StaticRaggedCache, "compact", lambda self: (compactions.append(1), compact(self)))
    kept_slots, keep_tail = [], StaticRaggedCache.keep_tail
    monkeypatch.setattr(StaticRaggedCache, "keep_tail",
                        lambda self, block, kept: (kept_slots.extend(kept), keep_tail(self, block, kept)))

    out = model.generate(ids, attention_mask=mask, compile="wait", **kwargs)
    assert check_rows(model, prompts, out, width, kwargs) == 0
    stats = model.last_generation_stats
    assert stats.verifier == "compiled" and stats.method.endswith("/cost-aware+batch")
    assert any(k != list(range(len(k))) for k in kept_slots)  # a later branch accepted: slots kept in place, holes
    per_step = list(zip(*[row.accepted_lengths[2:] for row in stats.rows]))
    assert any(len(set(step)) > 2 for step in per_step)  # ragged: rows accepted different lengths together
    assert all(row.block_efficiency > 1.5 for row in stats.rows)
    assert compactions, batched._RUNNERS[model.base_lm].keys()
    branching["on"] = False

    # rows stop at their own EOS: finished rows ride along, then the rest move to a runner of fewer rows
    stops = {t: sum(t in lone[r][:30] for r in range(6)) for t in range(3, VOCAB)}
    eos = max(stops, key=stops.get)
    kwargs_eos = dict(kwargs, eos_token_id=eos)
    monkeypatch.setattr("hf_bpd.generation.batch_cache.SHRINK", 2)  # runners of 6, then 4 (powers of 2) rows
    charged, select = [], StaticRaggedCache.select
    monkeypatch.setattr(StaticRaggedCache, "select",
                        lambda self, rows: (select(self, rows), charged.append((self.step_rows, self.runner.rows))))
    out = model.generate(ids, attention_mask=mask, compile="wait", **kwargs_eos)
    assert check_rows(model, prompts, out, width, kwargs_eos) == 0
    assert stops[eos] >= 3  # at most 3 rows left: they fit 4 rows
    assert {rows for rows, _, _ in batched._RUNNERS[model.base_lm]} >= {6, 4}
    # the width choice is told the rows each step computes: the runner's, also after the move to a smaller one
    assert (4, 4) in charged and all(step == runner for step, runner in charged)


@pytest.mark.skipif(kernels_unsupported_reason() is not None, reason="hf_bpd's bf16 kernels need AVX512-BF16 or AVX2")
def test_bf16_compiled_batch_rows_equal_their_lone_compiled_output(monkeypatch):
    """A bf16 base's compiled batch (hf_bpd's kernels, each row over its own positions): every row equals the same
    prompt's lone compiled plain decoding bit for bit (no near-tie allowance), with forced drafts that branch at their
    root in every other step, rows accepting different lengths in one step, holes, a compacted cache, and rows that
    stop at their own EOS, ride along and move to a runner of fewer rows."""
    from tests.test_kernels import _head_dim_16_bpd

    model = _head_dim_16_bpd(hidden_size=256, layers=4)  # wide enough for bf16's rounding to show
    prompts = random_prompts(6, seed=5, longest=20)
    kwargs = dict(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    width = ids.shape[1]

    def lone_compiled(kw):  # each prompt's compiled plain decoding: (tokens, raw logits of each new token)
        outs = [model.generate(p[None], use_heads=False, compile=True, output_logits=True,
                               return_dict_in_generate=True, **kw) for p in prompts]
        return [o.sequences[0, len(p):].tolist() for p, o in zip(prompts, outs)], [o.logits for o in outs]

    def assert_equal_bits(out, want, logits):  # every row's tokens and logits, bit for bit
        for r, (row, row_logits) in enumerate(zip(want, logits)):
            assert out.sequences[r, width: width + len(row)].tolist() == row, r
            assert all(torch.equal(out.logits[t][r], row_logits[t][0]) for t in range(len(row))), r

    want, logits = lone_compiled(kwargs)
    branching = {"on": True}
    reference_drafts(monkeypatch, model, prompts, width, kwargs, branching, dict(enumerate(want)))
    monkeypatch.setattr(batched, "CACHE_BUCKET", 1)  # a cache just as long as the call: holes force compaction
    compactions, compact = [], StaticRaggedCache.compact
    monkeypatch.setattr(StaticRaggedCache, "compact", lambda self: (compactions.append(1), compact(self)))
    out = model.generate(ids, attention_mask=mask, compile="wait", output_logits=True, return_dict_in_generate=True,
                         **kwargs)
    assert_equal_bits(out, want, logits)
    stats = model.last_generation_stats
    assert stats.verifier == "compiled" and compactions
    per_step = list(zip(*[row.accepted_lengths[2:] for row in stats.rows]))
    assert any(len(set(step)) > 2 for step in per_step)  # ragged: rows accepted different lengths together
    assert all(row.block_efficiency > 1.5 for row in stats.rows)
    assert batched._RUNNERS[model.base_lm] and all(r.ordered for r in batched._RUNNERS[model.base_lm].values())

    plain = model.generate(ids, attention_mask=mask, use_heads=False, compile="wait", output_logits=True,
                           return_dict_in_generate=True, **kwargs)  # compiled plain batches
    assert_equal_bits(plain, want, logits)
    assert model.last_generation_stats.verifier == "compiled"

    branching["on"] = False  # rows stop at their own EOS, ride along, then move to a runner of fewer rows
    stops = {t: sum(t in row[:20] for row in want) for t in range(3, VOCAB)}
    kwargs_eos = dict(kwargs, eos_token_id=max(stops, key=stops.get))
    monkeypatch.setattr("hf_bpd.generation.batch_cache.SHRINK", 2)
    out = model.generate(ids, attention_mask=mask, compile="wait", output_logits=True, return_dict_in_generate=True,
                         **kwargs_eos)
    assert_equal_bits(out, *lone_compiled(kwargs_eos))
    assert min(rows for rows, _, _ in batched._RUNNERS[model.base_lm]) < 6  # the rows left moved to a smaller runner
    batched.discard_batched_runners(model.base_lm)


def test_shapes_past_the_memory_bound_run_eagerly_on_the_same_cache(monkeypatch):
    """Each compiled shape holds a packed copy of the weights: past `MAX_GRAPH_BYTES` (here: 2 shapes) a new block
    width runs the step eagerly on the static cache, and the rows stay exact."""
    model = random_bpd("gemma3", 1)  # sliding-window layers: the batch's own masks per layer type
    prompts = random_prompts(3, seed=8, longest=12)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    reference_drafts(monkeypatch, model, prompts, ids.shape[1], kwargs)
    monkeypatch.setattr(batched, "MAX_GRAPH_BYTES", 1)
    assert batched.max_graphs(model.base_lm) == 2  # the floor: a plain and a drafted width
    monkeypatch.setattr(batched, "max_graphs", lambda base: 1)
    widths, run = [], batched.BatchedRunner.run
    monkeypatch.setattr(batched.BatchedRunner, "run",
                        lambda self, tokens, *rest: (widths.append(tokens.shape[1]), run(self, tokens, *rest))[1])
    out = model.generate(ids, attention_mask=mask, compile="wait", **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    assert batched.compiled_graphs(model.base_lm) == 1 and len(set(widths)) >= 2


def test_a_failing_compiler_falls_back_to_eager_steps_on_the_same_cache(monkeypatch):
    """A compiler that fails in a batch: one warning, the step runs eagerly on the static cache, rows stay exact."""
    model = random_bpd("gpt2", 2)
    prompts = random_prompts(3, seed=4, longest=10)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(batched.torch, "compile", lambda module, **kw: broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, attention_mask=mask, compile="wait", **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    assert sum("compiling the batched step failed (RuntimeError: no C++ compiler)" in str(w.message)
               for w in caught) == 1
    assert batched.compiled_graphs(model.base_lm) == 0


def test_plain_compiled_batches_and_eager_fallbacks():
    """`use_heads=False, compile="wait"`: one-token compiled steps for every row; `compile=True` without an artifact
    (artifacts off here; `tests/test_artifacts.py` runs batches on one) verifies eagerly with a one-line warning that
    names `compile="wait"` (it never compiles for minutes in a call); bf16 batches the kernels cannot serve (here: a
    head dim of 8) verify eagerly with a one-line warning."""
    model = random_bpd("qwen2", 1)
    prompts = random_prompts(5, seed=9, longest=16)
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, use_heads=False, compile="wait", **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    stats = model.last_generation_stats
    assert stats.verifier == "compiled" and stats.forward_passes == 12 and sum(stats.draft_tokens) == 0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert model.last_generation_stats.verifier == "eager"
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    told = [str(w.message) for w in caught if "the batch verifies eagerly" in str(w.message)]
    assert len(told) == 1 and "HF_BPD_OFF=artifacts" in told[0] and 'compile="wait"' in told[0]
    assert "\n" not in told[0]

    half = copy.deepcopy(random_bpd("llama", 2)).to(torch.bfloat16)  # random_bpd's models are shared
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        half.generate(ids, attention_mask=mask, compile="wait", **kwargs)
    assert half.last_generation_stats.verifier == "eager"
    assert any("bf16 batches verify eagerly where hf_bpd's kernels do not run" in str(w.message) for w in caught)


def test_the_static_cache_is_bounded(monkeypatch):
    """Runners whose static caches would pass `MAX_CACHE_BYTES` together are not made (the batch verifies eagerly)."""
    model = random_bpd("llama", 3)
    monkeypatch.setattr(batched, "MAX_CACHE_BYTES", 64 << 20)
    per_row_slot = batched.cache_bytes(model.base_lm, 1, 1)
    assert batched.cache_bytes(model.base_lm, 4, 512) == 4 * 512 * per_row_slot
    rows = batched.MAX_CACHE_BYTES // (per_row_slot * 4096) + 1
    assert batched.batched_runner(model.base_lm, rows, 4096) is None
    half = batched.batched_runner(model.base_lm, rows // 2, 4096)  # fits alone; a second one would not
    assert half is not None and batched.batched_runner(model.base_lm, rows // 2 + 1, 4096) is None
    assert batched.batched_runner(model.base_lm, rows // 2, 4000) is half  # an existing runner is reused
