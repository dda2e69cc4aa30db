"""A batch of prompts in one `generate()`: every row equals the base's own `generate()` for that prompt alone
(greedy), rows accept different numbers of tokens per step, finish at different times, and sampling keeps the base's
distribution per row.

Floating-point sums over a padded batch differ from a lone sequence's in the last bits, so a row may leave the lone
output only where the base's two best logits are within `TIE` of each other (as transformers' own batched decoding
may); the tests check every difference is such a near-tie, and count them.
"""

import pytest
import torch
from transformers import SynthIDTextWatermarkingConfig
from transformers.generation import TextStreamer
from transformers.generation.streamers import BaseStreamer

from hf_bpd import BlockwiseParallelForCausalLM, BPDConfigError, Rescorer
from hf_bpd.lattice import Draft
from hf_bpd.evaluation.batch_bench import left_pad
from tests.conftest import ARCHS, VOCAB, differs_at_a_near_tie, tiny_base
from tests.test_decoding import MODES, random_bpd
from tests.test_sampling import NEW, PROMPT, V, chi2_pvalue, exact_joint
from tests.test_sampling import model  # noqa: F401 - the sampling test's fixture

TIE = 1e-4
PAD = 0


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = left_pad(prompts, PAD)
    return batch["input_ids"], batch["attention_mask"]


def random_prompts(count: int, seed: int, longest: int = 40) -> list[torch.Tensor]:
    """Prompts of very different lengths (1 to `longest` tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=g).tolist()
    lengths[0] = 1 if seed % 2 else longest  # always one extreme
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


class ReferenceRescorer(Rescorer):
    """Knows every prompt's lone greedy continuation; drafts it, corrupted at a position that depends on the row and
    step, so rows accept different lengths at every step (0 to all heads)."""

    def __init__(self, references: dict[tuple, list[int]]):
        self.references = references

    def rescore(self, lattice, context, num_drafts):
        n = lattice.num_heads
        reference = next(ref for prompt, ref in self.references.items() if tuple(context[: len(prompt)]) == prompt
                         and len(ref) >= len(context))
        truth = list(reference[len(context): len(context) + n]) + [3] * n
        wrong = (len(context) * 7 + len(reference)) % (n + 2)  # n or n + 1: nothing corrupted
        if wrong < n:
            truth[wrong] = (truth[wrong] + 1) % VOCAB
        return [Draft(tuple(truth[:n]), 0.0)]


def check_rows(model, prompts, output, prompt_width, kwargs) -> int:
    """Every row against the base's lone generate(); returns how many rows differ (each only at a near-tie)."""
    differ = 0
    for r, prompt in enumerate(prompts):
        alone = model.base_lm.generate(prompt[None], **kwargs, output_scores=True, return_dict_in_generate=True)
        differ += differs_at_a_near_tie(output[r, prompt_width:], alone, len(prompt), TIE,
                                        f"row {r} (prompt of {len(prompt)})")
    return differ


@pytest.mark.parametrize("batch_size", [2, 4, 8, 16])
def test_rows_equal_the_lone_greedy_output(batch_size):
    """50 prompt sets per batch size, 4 architectures x chain / p-best / tree drafting, prompts of 1 to 40 tokens in
    one batch."""
    differ = total = 0
    modes = sorted(MODES)
    for s in range(50):
        arch, mode = ARCHS[s % len(ARCHS)], modes[s % len(modes)]
        model = random_bpd(arch, s % 4)
        prompts = random_prompts(batch_size, seed=100 * batch_size + s)
        ids, mask = left_padded(prompts)
        kwargs = dict(max_new_tokens=8 + s % 9, do_sample=False, eos_token_id=None, pad_token_id=PAD)
        out = model.generate(ids, attention_mask=mask, **MODES[mode], **kwargs)
        differ += check_rows(model, prompts, out, ids.shape[1], kwargs)
        total += batch_size
    assert differ <= total // 50, f"{differ} of {total} rows differ (at near-ties)"


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_acceptance_every_step(arch, monkeypatch):
    """Rows accept 0..all drafted tokens in the same step (a rescorer that knows the answers, corrupted per row and
    step), the cache is cut and compacted, and every row stays exact."""
    from hf_bpd.generation.batch_cache import RaggedCache

    compactions, compact = [], RaggedCache.compact
    monkeypatch.setattr(RaggedCache, "compact", lambda self: (compactions.append(1), compact(self)))
    monkeypatch.setattr("hf_bpd.generation.batch_cache.COMPACT_HOLES", 0.05)  # compact often: every row stays exact
    model = random_bpd(arch, 0)
    prompts = random_prompts(6, seed=7, longest=30)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    references = {tuple(p.tolist()): model.base_lm.generate(p[None], **kwargs)[0].tolist() for p in prompts}
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, rescorer=ReferenceRescorer(references), draft_top_k=2, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    stats = model.last_generation_stats
    rows = stats.rows
    assert len(rows) == 6 and all(row.new_tokens == 40 for row in rows)
    assert all(row.block_efficiency > 1.5 for row in rows)
    per_step = list(zip(*[row.accepted_lengths[1:] for row in rows]))
    assert any(len(set(step)) > 2 for step in per_step)  # ragged: rows accepted different lengths together
    assert compactions  # holes piled up past COMPACT_HOLES and the cache was compacted mid-decoding
    assert stats.forward_passes < 40 and stats.block_efficiency == pytest.approx(
        sum(r.new_tokens for r in rows) / sum(r.serial_calls for r in rows))


def test_rows_stop_at_their_own_eos_and_leave_the_batch():
    model = random_bpd("llama", 1)
    prompts = random_prompts(5, seed=3)
    lone = [model.base_lm.generate(p[None], max_new_tokens=30, do_sample=False, eos_token_id=None)[0, len(p):]
            for p in prompts]
    tokens = lone[2].tolist()
    stop = next(i for i in range(2, 30) if tokens[i] not in tokens[:i])  # row 2's first EOS: its new token `stop`
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=tokens[stop], pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    row2 = out[2, ids.shape[1]:].tolist()
    assert row2[: stop + 1] == tokens[: stop + 1] and set(row2[stop + 1:]) <= {PAD}  # right-padded after its EOS
    stats = model.last_generation_stats
    assert stats.rows[2].new_tokens == stop + 1 and max(r.new_tokens for r in stats.rows) > stop + 1


def test_scores_and_stats_per_row():
    model = random_bpd("qwen2", 2)
    prompts = random_prompts(3, seed=11)
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                         pad_token_id=PAD, return_dict_in_generate=True, output_scores=True)
    assert len(out.scores) == 8 and out.scores[0].shape == (3, VOCAB)
    plain = model.base_lm.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                   pad_token_id=PAD, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, plain.sequences)  # transformers' batched plain decoding, same padding
    for ours, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert out.generation_stats.method.endswith("+batch") and len(out.generation_stats.rows) == 3


ROW_PROCESSORS = {
    "repetition": {"repetition_penalty": 1.5},  # each row's padding length (`prompt_ignore_length`)
    "encoder-repetition": {"encoder_repetition_penalty": 5.0},  # each row's prompt
    "encoder-ngram": {"encoder_no_repeat_ngram_size": 1},
    "prefix": {"prefix_allowed_tokens_fn": lambda row, sent: [t for t in range(VOCAB) if t % 3 != row]},
    "synthid": {"watermarking_config": SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123], ngram_len=3)},
    "guidance": {"guidance_scale": 3.0},  # each row's unconditional sequence
    "guidance-negative": {"guidance_scale": 3.0, "negative_prompt_ids": torch.tensor([[5, 6], [7, 8], [9, 10]])},
}


@pytest.mark.parametrize("processor", list(ROW_PROCESSORS))
def test_logits_processors_holding_something_per_row_read_each_rows_own(processor):
    """transformers builds some processors for the whole batch (per-row padding lengths, prompts, the row index a
    prefix constraint is asked for, the watermark's and classifier-free guidance's per-row state); every row reads
    its own: the batch equals transformers' batched plain decoding, and differs from the batch without the
    processor."""
    model = random_bpd("llama", 0)
    ids, mask = left_padded(random_prompts(3, seed=8, longest=12))  # each processor changes this batch's output
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, **kwargs, **ROW_PROCESSORS[processor])
    assert model.last_generation_stats.method.endswith("+batch")
    assert torch.equal(out, model.base_lm.generate(ids, attention_mask=mask, **kwargs, **ROW_PROCESSORS[processor]))
    assert not torch.equal(out, model.generate(ids, attention_mask=mask, **kwargs))
    torch.manual_seed(0)  # sampled too
    sampled = model.generate(ids, attention_mask=mask, **dict(kwargs, do_sample=True), **ROW_PROCESSORS[processor])
    assert sampled.shape == out.shape


def test_batch_errors_are_one_line():
    model = random_bpd("llama", 0)
    ids, mask = left_padded(random_prompts(2, seed=1))
    right = torch.stack([mask[0].flip(0), mask[1].flip(0)])
    with pytest.raises(BPDConfigError, match="needs left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(BPDConfigError, match="streams to one streamer per row"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD,
                       streamer=TextStreamer(tokenizer=None))


def test_a_padded_prompt_alone_decodes_as_a_batch_of_one():
    """A lone prompt with left padding (a pipeline's `padding="max_length"`) is decoded as a batch's row: it equals
    transformers' plain decoding of the same padded input."""
    model = random_bpd("llama", 0)
    prompt = random_prompts(1, seed=1, longest=9)[0]
    ids = torch.cat([torch.full((1, 6), PAD), prompt[None]], dim=1)
    mask = (torch.arange(ids.shape[1]) >= 6).long()[None]
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    assert model.last_generation_stats.method.endswith("+batch")
    assert torch.equal(out, model.base_lm.generate(ids, attention_mask=mask, **kwargs))


class Recorder(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], 0

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.ended += 1


def test_each_row_streams_to_its_own_streamer():
    """`streamer=[one per prompt]`: each gets its row's own prompt, then exactly its accepted tokens (up to its EOS),
    and is ended once, when its row stops."""
    model = random_bpd("qwen2", 1)
    prompts = random_prompts(3, seed=5)
    ids, mask = left_padded(prompts)
    streamers = [Recorder() for _ in prompts]
    lone = model.base_lm.generate(prompts[1][None], max_new_tokens=20, do_sample=False, eos_token_id=None)
    eos = int(lone[0, len(prompts[1]) + 6])  # row 1 stops early, at the first occurrence of this token
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                         pad_token_id=PAD, streamer=streamers)
    for r, (prompt, streamer) in enumerate(zip(prompts, streamers)):
        row = out[r, ids.shape[1]:].tolist()
        if eos in row:
            row = row[: row.index(eos) + 1]
        assert streamer.tokens == prompt.tolist() + row and streamer.ended == 1
    one = Recorder()  # a list of one streamer for a single prompt works too
    model.generate(prompts[0][None], max_new_tokens=5, do_sample=False, eos_token_id=None, streamer=[one])
    assert one.ended == 1 and len(one.tokens) == len(prompts[0]) + 5


@pytest.mark.parametrize("temperature", [1.0])
def test_batched_sampling_matches_the_base_distribution(model, temperature):  # noqa: F811
    """Rows of one batch are independent samples of the base's distribution, whatever their padding: two prompts
    (the second a shorter, left-padded one) x 4 rows each per call."""
    short = PROMPT[:, 1:]
    ids = torch.cat([PROMPT.repeat(4, 1), torch.cat([torch.zeros(4, 1, dtype=torch.long), short.repeat(4, 1)], 1)])
    mask = torch.ones_like(ids)
    mask[4:, 0] = 0
    counts = [{}, {}]
    torch.manual_seed(4321)
    calls = 5000 // 4
    for _ in range(calls):
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                             max_new_tokens=NEW, pad_token_id=0)
        for r in range(8):
            outcome = tuple(out[r, ids.shape[1]:].tolist())
            counts[r // 4][outcome] = counts[r // 4].get(outcome, 0) + 1
    for group, prompt in zip(counts, (PROMPT, short)):
        probs = exact_joint_for(model.base_lm, prompt, temperature)
        p = chi2_pvalue(group, probs)
        assert p > 1e-3, f"batched sampling for prompt {prompt.tolist()} differs from the base (p={p:.2e})"


def exact_joint_for(base, prompt, temperature):
    import tests.test_sampling as sampling

    saved = sampling.PROMPT
    sampling.PROMPT = prompt
    try:
        return exact_joint(base, temperature)
    finally:
        sampling.PROMPT = saved


def test_batched_bpd_with_a_plain_base_layout_model(tmp_path):
    """A model loaded from disk with the real loading path and a batch of two, as a user would call it."""
    base_dir = tmp_path / "base"
    tiny_base("gemma3").save_pretrained(base_dir)
    model = BlockwiseParallelForCausalLM.from_base(str(base_dir), num_heads=3)
    prompts = [torch.arange(3, 3 + 20) % V + 3, torch.tensor([5, 6, 7])]
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, **kwargs)  # sliding window 8 < 30 new tokens
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0


# ------------------------------------------------------------------ the cost-aware width
def test_the_width_follows_costs_and_acceptance():
    """`BatchWidth.choose`: flat costs take the widest block, costs growing with every token a plain step; rows that
    accept everything make a wide block pay where rows that accept nothing do not; the width that finishes every row
    soonest wins (rows leave as they finish); timings replace the table."""
    from hf_bpd.generation.controller import BatchWidth, shadow_accepted

    def width(costs, rows, max_width=5):  # after a call's first step, plain, timed as the table says
        policy = BatchWidth(costs, max_width=max_width, rows=rows)
        assert policy.choose(list(range(rows))) == 1
        policy.costs.timing(rows, policy.costs.tabled(rows))
        return policy

    flat = width({1: 10.0, 64: 10.0}, 4)
    # prior rates 0.5, lowered by half their standard error over 4 pseudo-observations to 0.375: a 4th token would
    # add 3.5 %, under MARGIN
    assert flat.choose([0, 1, 2, 3]) == 3
    steep = width({1: 10.0, 64: 640.0}, 4)
    assert steep.choose([0, 1, 2, 3]) == 1
    assert steep.costs(8) == pytest.approx(80.0) and steep.costs(128) == pytest.approx(1280.0)
    # cost(n) = 10 + n: rows that accept every draft token pay for the widest block, rows that never do for none
    sloped = {1: 11.0, 256: 266.0}
    good, bad = width(sloped, 16), width(sloped, 16)
    for _ in range(50):
        for r in range(16):
            good.record(r, 4, 4)
            bad.record(r, 4, 0)
    assert good.choose(list(range(16))) == 5 and bad.choose(list(range(16))) == 1
    # the batch goes at its slowest row's pace: one row that accepts nothing, with as much left as the others, rules
    # it; with less left it finishes first anyway and the rest draft
    lagging = width(sloped, 16)
    for _ in range(50):
        for r in range(16):
            lagging.record(r, 4, 4 if r < 15 else 0)
    assert lagging.choose(list(range(16)), remaining=[10] * 16) == 1
    assert lagging.choose(list(range(16)), remaining=[10] * 15 + [2]) == 5
    # finished rows leave the step (dynamic rows) or ride along (a compiled shape): with 7 left to the row that
    # accepts nothing, its last steps alone are cheap in the first case only
    assert lagging.choose(list(range(16)), remaining=[10] * 15 + [7]) == 2
    assert lagging.choose(list(range(16)), remaining=[10] * 15 + [7], computed=lambda active: 16) == 1
    assert lagging.finish_ms([1.0] * 16, [10] * 16, 1) == pytest.approx(10 * 26.0)
    good = lagging
    for _ in range(10):  # this call's own steps: plain ones as the table says, wide ones far slower
        good.costs.timing(16, 26.0)
        good.costs.timing(80, 10_000.0)
    assert good.choose(list(range(16)), remaining=[10] * 15 + [2]) < 5
    assert shadow_accepted([4, 5, 6], [4, 5, 9, 9]) == (3, 2) and shadow_accepted([4, 5, 6], [4]) == (1, 1)


def test_a_rate_seen_little_counts_for_less_than_the_same_rate_seen_much(monkeypatch):
    """The width choice lowers each row's rate by `CONFIDENCE` standard errors: 3 of 5 drafts accepted do not pay
    for a block that 240 of 400 pay for (the same rate); without the lowering both would draft."""
    from hf_bpd.generation import controller
    from hf_bpd.generation.controller import BatchWidth

    def policy(tries, hits):
        p = BatchWidth({1: 10.0, 2: 14.5, 4096: 1e6}, 2, 1)
        p.costs.timing(1, 10.0)
        for i in range(tries):
            p.record(0, 1, int(i < hits))
        return p

    little, much = policy(5, 3), policy(400, 240)
    assert little.rates(0)[0] < 0.5 < 0.58 < much.rates(0)[0] < 0.6
    assert little.choose([0]) == 1 and much.choose([0]) == 2
    monkeypatch.setattr(controller, "CONFIDENCE", 0.0)
    assert little.choose([0]) == 2


def test_drafted_steps_that_deliver_less_than_plain_ones_raise_the_bar():
    """The realized guard: a width the estimates favour by ~10 % is taken until this call's drafted steps have
    delivered fewer tokens per ms than its plain steps; a clear win (over `GUARD_MARGIN`) still drafts."""
    from hf_bpd.generation.controller import GUARD_STEPS, BatchWidth

    def policy(cost_two):
        p = BatchWidth({1: 10.0, 2: cost_two, 4096: 1e6}, 2, 1)
        p.costs.timing(1, 10.0)
        for _ in range(20):
            p.record(0, 1, 1)  # every draft accepted: a width of 2 gains ~2 tokens
        return p

    p = policy(18.0)  # 2 tokens per 18 ms against 1 per 10 ms: ~11 % better
    assert p.choose([0]) == 2 and not p.losing()
    for _ in range(GUARD_STEPS):
        p.stepped(1, None)
        p.delivered(1, 1.0, 10.0)
        p.stepped(2, 0.0)
        p.delivered(2, 1.5, 18.0)  # what the drafted steps really gave: 1.5 tokens (the estimate: ~2)
    assert p.losing() and p.choose([0]) == 1
    clear = policy(12.0)  # ~67 % better: drafts even while losing
    clear.realized = p.realized
    assert clear.losing() and clear.choose([0]) == 2


def test_drafted_widths_are_charged_what_drafting_the_rows_costs():
    """The shadow probes' per-row time stands in for drafting's cost only until a drafted step ran; then a drafted
    width is charged the drafted steps' own per-row time, for the rows of the step."""
    from hf_bpd.generation.controller import BatchWidth

    p = BatchWidth({1: 10.0, 4: 20.0, 8: 30.0, 4096: 1e6}, 2, 4)
    p.costs.timing(4, 20.0)
    for r in range(4):
        for _ in range(20):
            p.record(r, 1, 1)  # every draft accepted: a width of 2 gains ~2 tokens per row
    for _ in range(3):
        p.stepped(1, 2.0, 4)  # probes: 0.5 ms a row
    assert p.drafting_cost(4) == pytest.approx(2.0) and p.choose([0, 1, 2, 3]) == 2  # ~2 / 32 ms vs 1 / 20 ms
    p.stepped(2, 40.0, 4)  # a drafted step's drafting: 10 ms a row
    assert p.drafting_cost(4) == pytest.approx(40.0) and p.choose([0, 1, 2, 3]) == 1  # ~2 / 70 ms: plain
    assert p.drafting_cost(1) == pytest.approx(10.0)
    p.stepped(1, 2.0, 4)  # later probes leave the drafted steps' figure alone
    assert p.drafting_cost(4) == pytest.approx(40.0)


def test_a_probe_drafts_each_rows_rescored_best_path(monkeypatch):
    """While drafting does not pay (steep forced costs: every step plain), the probes' shadow drafts are what a
    drafted step would verify first, each row's best path as its drafter rescores it, not the heads' argmax chain:
    with a rescorer that knows the rows' continuations (random heads' argmax chains are almost never accepted) most
    shadow tokens are accepted, and every row stays exact."""
    from hf_bpd.generation import batch, controller

    scored = []

    def recording(draft, decoded):
        scored.append(controller.shadow_accepted(draft, decoded))
        return scored[-1]

    monkeypatch.setattr(batch, "shadow_accepted", recording)
    monkeypatch.setattr(batch, "eager_costs", lambda base, max_tokens: {1: 10.0, 4096: 40960.0})
    monkeypatch.setattr(controller, "TIMING_WEIGHT", 0.0)  # the forced table, not this machine's timings
    monkeypatch.setattr(controller, "PROBE_EVERY", 2)  # probes often: a short call scores several
    model = random_bpd("llama", 0)
    prompts = random_prompts(3, seed=9, longest=20)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    references = {tuple(p.tolist()): model.base_lm.generate(p[None], **kwargs)[0].tolist() for p in prompts}
    ids, mask = left_padded(prompts)
    # the model's defaults, not the call's options (which make each row draft as they say, every draft verified)
    monkeypatch.setattr(model.generation_config, "rescorer", ReferenceRescorer(references))  # (a shared model)
    monkeypatch.setattr(model.generation_config, "draft_top_k", 2)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    stats = model.last_generation_stats
    assert stats.method == "chain/cost-aware+batch"  # one path a row (`num_drafts=1`), weighed by the switch
    assert sum(n for row in stats.rows for n in row.draft_tokens) == 0  # nothing verified: every step plain
    tried, accepted = map(sum, zip(*scored))
    assert len(scored) >= 6 and accepted > 0.5 * tried, scored  # the reference's tokens up to its corruption


def test_a_probe_drafts_a_few_rows_in_turn(monkeypatch):
    """A probe drafts at most `PROBE_ROWS` rows, those probed longest ago (a probe of every row cost up to a quarter of
    a plain step at 16 rows): over a call every row is probed and scored, and every row stays exact."""
    from hf_bpd.generation import batch, controller

    probes, policies = [], []

    class Recording(controller.BatchWidth):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            policies.append(self)

        def stepped(self, width, drafting_ms, rows=1):
            if width == 1 and drafting_ms is not None:
                probes.append(rows)
            super().stepped(width, drafting_ms, rows)

    monkeypatch.setattr(batch, "BatchWidth", Recording)
    monkeypatch.setattr(batch, "eager_costs", lambda base, max_tokens: {1: 10.0, 4096: 40960.0})
    monkeypatch.setattr(controller, "TIMING_WEIGHT", 0.0)  # the forced table: every step plain
    monkeypatch.setattr(controller, "PROBE_EVERY", 2)
    model = random_bpd("llama", 0)
    prompts = random_prompts(10, seed=5, longest=16)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    assert sum(n for row in model.last_generation_stats.rows for n in row.draft_tokens) == 0  # every step plain
    (policy,) = policies
    assert len(probes) >= 3 and max(probes) <= controller.PROBE_ROWS, probes  # 10 rows: 3 probes reach all
    assert all(tries[0] > 0 for tries in policy.tries), policy.tries  # every row's shadow draft scored


@pytest.mark.parametrize("costs, drafting", [({1: 1e6, 4096: 1e6}, True), ({1: 10.0, 4096: 40960.0}, False)],
                         ids=["flat-costs-draft", "steep-costs-plain"])
def test_the_switch_turns_drafting_on_and_off_and_rows_stay_exact(costs, drafting, monkeypatch):
    """Forced cost tables through `generate()`: flat costs (drafting's own milliseconds negligible beside them) verify
    drafts at every step, costs that grow with every token decode plainly (only shadow drafts, nothing verified);
    every row equals its lone output."""
    from hf_bpd.generation import controller

    monkeypatch.setattr("hf_bpd.generation.batch.eager_costs", lambda base, max_tokens: dict(costs))
    monkeypatch.setattr(controller, "TIMING_WEIGHT", 0.0)  # the forced table, not this machine's timings
    monkeypatch.setattr(controller, "MARGIN", 0.0)  # random heads: any expected gain is to be taken
    monkeypatch.setattr(controller, "CONFIDENCE", 0.0)  # nor lowered by its uncertainty
    model = random_bpd("llama", 0)
    prompts = random_prompts(4, seed=21)
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    stats = model.last_generation_stats
    assert stats.method == "chain/cost-aware+batch"
    verified = [n for row in stats.rows for n in row.draft_tokens[1:]]
    if drafting:
        # the first step measures the batch plainly, the last may have no room left
        assert all(n >= 1 for row in stats.rows for n in row.draft_tokens[2:-1])
    else:
        assert sum(verified) == 0 and stats.forward_passes == 24
