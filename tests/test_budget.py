"""Cost-aware drafting (`draft_schedule="cost"`): the choice rule, the calibration fit, and exact decoding with it."""

import json

import pytest
import torch

from hf_bpd import BPDConfigError
from hf_bpd.evaluation.calibration import acceptance_records, calibrate, reliability_table
from hf_bpd.generation.calibration import HeadCalibration
from hf_bpd.generation.controller import CostSchedule, eager_costs
from hf_bpd.generation.stats import GenerationStats
from tests.test_decoding import OracleRescorer, prompt_ids, random_bpd


def test_the_budget_verifies_what_pays_for_itself():
    flat = CostSchedule({1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 5: 12.0})  # verifying more is nearly free
    assert flat.choose([0.9, 0.8, 0.7, 0.6]) == 4
    assert flat.choose([0.02, 0.9, 0.9, 0.9]) == 0  # the first token will not be accepted: the rest cannot be
    steep = CostSchedule({1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0, 5: 50.0})  # each token costs a whole forward
    assert steep.choose([0.99, 0.99, 0.99, 0.99]) == 0  # E(k) <= k + 1 never beats the k + 1 cost
    # eager-like: 2..5 tokens cost ~1.7x one token, so the drafts must be confident enough
    eager = CostSchedule({1: 70.0, 2: 120.0, 3: 122.0, 4: 124.0, 5: 126.0})
    assert eager.choose([0.3, 0.2, 0.1, 0.1]) == 0
    assert eager.choose([0.9, 0.8, 0.7, 0.6]) == 4
    # noisy measurements: a longer block is never charged less than a shorter one, so drafts that cannot pay are
    # not verified because their length happened to time faster
    noisy = CostSchedule({1: 10.0, 2: 9.6, 3: 9.9, 4: 9.5})
    assert noisy.costs.table == [10.0, 10.0, 10.0, 10.0] and noisy.choose([0.0, 0.0, 0.0]) == 0
    # measured buckets only: a block is charged at the next compiled length that holds it
    buckets = CostSchedule({1: 18.0, 5: 25.0})
    assert buckets.choose([0.9, 0.9, 0.9, 0.9]) == 4 and buckets.choose([0.1, 0.1, 0.1, 0.1]) == 0
    # overhead per step (drafting) makes verifying more tokens relatively cheaper
    assert eager.choose([0.55, 0.3, 0.2, 0.1]) == 0 and eager.choose([0.55, 0.3, 0.2, 0.1], overhead_ms=200) >= 2


def test_the_budget_weighs_how_many_nodes_to_verify():
    """`choose_nodes`: the count of likeliest nodes with the most expected tokens per millisecond, at the measured
    block lengths (SmolLM2 bf16-like: a block of 4 costs little more than one token, a block of 8 much more)."""
    budget = CostSchedule({1: 10.0, 4: 11.0, 8: 16.0})
    assert budget.choose_nodes([0.9] * 7) == 7  # (1 + 6.3) / 16 beats (1 + 2.7) / 11
    assert budget.choose_nodes([0.6, 0.3, 0.2, 0.05, 0.05, 0.05, 0.05]) == 3  # the tail does not pay for 8
    assert budget.choose_nodes([0.02] * 7) == 0  # a plain step: (1 + 0.06) / 11 < 1 / 10
    assert budget.choose_nodes([0.9, 0.9]) == 2  # fewer candidates than a block holds: all of them
    assert budget.choose_nodes([]) == 0
    # a large fixed overhead per step (drafting) makes the longer block relatively cheaper
    tail = [0.6, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1]
    assert budget.choose_nodes(tail) == 3 and budget.choose_nodes(tail, overhead_ms=60.0) == 7


def test_calibration_fit_and_lookup():
    records = [(0, 0.95, True)] * 90 + [(0, 0.95, False)] * 10 + [(0, 0.15, False)] * 50 + [(1, 0.5, True)] * 3
    cal = HeadCalibration.fit(records, num_heads=2, bins=10, prior=2.0)
    assert cal.rate(0, 0.95) == pytest.approx((90 + 2 * 0.95) / 102, abs=1e-4)
    assert cal.rate(0, 0.15) == pytest.approx(2 * 0.15 / 52, abs=1e-4)
    assert cal.rate(1, 0.5) == pytest.approx((3 + 2 * 0.5) / 5, abs=1e-4)
    assert cal.rate(0, 0.55) == pytest.approx(0.55, abs=1e-4)  # an empty bin: its centre
    assert cal.rate(3, 0.42) == 0.42  # a head the table does not cover: the raw probability
    assert HeadCalibration.from_dict(json.loads(json.dumps(cal.to_dict()))).accept == cal.accept
    with pytest.raises(BPDConfigError, match="head_calibration"):
        HeadCalibration.from_dict({"edges": 0.5})


def test_acceptance_records_count_only_tried_tokens():
    stats = GenerationStats(accepted_lengths=[0, 2, 0, 3], draft_tokens=[0, 3, 3, 3],
                            draft_probs=[[0.9, 0.8, 0.7], [0.2, 0.9, 0.9], [0.9, 0.9, 0.9]])
    assert acceptance_records(stats) == [(0, 0.9, True), (1, 0.8, True), (2, 0.7, False), (0, 0.2, False),
                                         (0, 0.9, True), (1, 0.9, True), (2, 0.9, True)]


def schedule_runs(schedule: str, options: dict, max_new_tokens: int):
    """Three prompts decoded with `draft_schedule=schedule` (`rescorer="oracle"`: drafts of the base's own output),
    each output checked against the base's greedy one; yields each call's statistics."""
    model = random_bpd("llama", 3)
    for seed in range(3):
        ids = prompt_ids(seed, 4 + 3 * seed)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
        expected = model.base_lm.generate(ids, **kwargs)
        call = dict(options)
        if call.get("rescorer") == "oracle":
            call["rescorer"] = OracleRescorer(expected[0].tolist())
        got = model.generate(ids, draft_schedule=schedule, **call, **kwargs)
        assert torch.equal(got, expected), (schedule, options, seed)
        yield model.last_generation_stats


@pytest.mark.parametrize("options", [{}, {"rescorer": "oracle"}, {"tree": (2, 2, 1)}])
def test_cost_schedule_decodes_exactly(one_thread, options):
    for stats in schedule_runs("cost", options, 20):
        assert len(stats.draft_probs) == stats.serial_calls - 1


def test_the_calibration_steers_how_much_is_verified(one_thread, monkeypatch):
    import hf_bpd.generation.decoding as decoding

    # forced costs (a tiny base's measured ones are nearly flat and noisy on a loaded machine): longer blocks cost a
    # little more, so only the calibration decides whether drafts pay
    monkeypatch.setattr(decoding, "eager_costs", lambda base, n, **_: {k: 10.0 + 0.5 * k for k in range(1, n + 1)})
    model = random_bpd("llama", 4)
    ids = prompt_ids(5, 6)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = model.base_lm.generate(ids, **kwargs)
    oracle = OracleRescorer(expected[0].tolist())
    edges = [(b + 1) / 10 for b in range(10)]
    try:
        model.config.head_calibration = {"edges": edges, "accept": [[0.0] * 10] * 3}  # drafts never pay
        assert torch.equal(model.generate(ids, draft_schedule="cost", rescorer=oracle, **kwargs), expected)
        assert set(model.last_generation_stats.draft_tokens) == {0}  # plain steps only
        model.config.head_calibration = {"edges": edges, "accept": [[1.0] * 10] * 3}  # drafts always pay
        assert torch.equal(model.generate(ids, draft_schedule="cost", rescorer=oracle, **kwargs), expected)
        assert model.last_generation_stats.block_efficiency > 3.0  # the oracle's drafts, all verified
    finally:
        model.config.head_calibration = None
    with pytest.raises(BPDConfigError, match="draft_schedule"):
        model.generate(ids, draft_schedule="sometimes", **kwargs)


def test_a_node_budget_verifies_the_nodes_that_pay(one_thread, monkeypatch):
    """With a node budget (`draft_nodes`) the cost schedule verifies the likeliest nodes up to the count that pays:
    blocks of more than 3 tokens are made expensive here, so confident drafts get 2 nodes, never the whole budget;
    unconfident ones none. Every output stays the base's own."""
    import hf_bpd.generation.decoding as decoding

    def costs(base, n, **_):
        return {k: 10.0 if k == 1 else 10.5 if k <= 3 else 30.0 for k in range(1, n + 1)}

    monkeypatch.setattr(decoding, "eager_costs", costs)
    model = random_bpd("llama", 4)
    ids = prompt_ids(5, 6)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, draft_nodes=5, num_drafts=2,
                  draft_top_k=2, draft_schedule="cost")
    expected = model.base_lm.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    edges = [(b + 1) / 10 for b in range(10)]
    try:
        model.config.head_calibration = {"edges": edges, "accept": [[1.0] * 10] * 3}  # drafts always pay
        assert torch.equal(model.generate(ids, rescorer=OracleRescorer(expected[0].tolist()), **kwargs), expected)
        assert set(model.last_generation_stats.draft_tokens[1:]) == {2}
        model.config.head_calibration = {"edges": edges, "accept": [[0.0] * 10] * 3}  # drafts never pay
        assert torch.equal(model.generate(ids, **kwargs), expected)
        assert set(model.last_generation_stats.draft_tokens) == {0}
    finally:
        model.config.head_calibration = None
    model.generate(ids, **{**kwargs, "draft_schedule": "fixed"})  # without the schedule: the whole budget
    assert max(model.last_generation_stats.draft_tokens) == 5


def test_calibrate_fits_every_head_and_eager_costs_are_cached(one_thread):
    model = random_bpd("llama", 6)
    prompts = [{"input_ids": prompt_ids(s, 5)} for s in range(2)]
    cal, records = calibrate(model, prompts, max_new_tokens=12, eos_token_id=None)
    assert len(cal.accept) == 3 and records and {h for h, _, _ in records} <= {0, 1, 2}
    assert "| 1 |" in reliability_table(cal, records)
    # a checkpoint shipped with the cost schedule: the rank factors' p-best paths (16 over 3 heads, a block of 49, more
    # than "cost" weighs) are ranked without it
    model.generation_config.draft_schedule = "cost"
    assert len(calibrate(model, prompts[:1], max_new_tokens=8, rank_paths=16, eos_token_id=None)[0].accept) == 3
    model.generation_config.draft_schedule = "fixed"
    costs = eager_costs(model.base_lm, 4, past=8, repeats=1)
    assert {1, 2, 4} <= set(costs) and min(costs.values()) > 0
    assert eager_costs(model.base_lm, 4) is costs  # measured once per process


def test_eager_costs_are_measured_once_per_machine(one_thread, tmp_path, monkeypatch):
    """The lengths measured in one process are kept in the cache: the next process reads them, measuring only a length
    it lacks (and adds it to the file)."""
    from hf_bpd.runtime import cost

    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    base = random_bpd("llama", 6).base_lm
    cost._EAGER_MS.pop(base, None)  # (other tests' lengths for this model)
    first = dict(eager_costs(base, 6, past=8, repeats=1))
    assert sorted(first) == [1, 2, 4, 6] and cost.eager_cost_file(base).is_file()
    cost._EAGER_MS.pop(base)  # as in a new process
    measured = []
    original = cost.measure_costs
    monkeypatch.setattr(cost, "measure_costs", lambda b, lengths, **kw: measured.append(list(lengths)) or
                        original(b, lengths, **kw))
    again = eager_costs(base, 8, past=8, repeats=1)
    assert measured == [[8]] and all(again[n] == first[n] for n in first)
    cost._EAGER_MS.pop(base)
    assert sorted(eager_costs(base, 8)) == [1, 2, 4, 6, 8] and measured == [[8]]  # nothing measured the third time


# ------------------------------------------------------------------ prompt-lookup path inside the lattice
def test_prompt_lookup_finds_the_latest_recurring_ngram():
    from hf_bpd.generation.lookup import prompt_lookup

    assert prompt_lookup([1, 2, 3, 4, 5, 9, 2, 3], 3) == (4, 5, 9)  # bigram (2, 3)
    assert prompt_lookup([1, 2, 3, 4, 5, 9, 7, 3], 3) == (4, 5, 9)  # only the unigram (3) recurs
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 3, 8, 1, 2, 3], 2) == (8, 1)  # the latest trigram wins
    assert prompt_lookup([7, 1, 2, 3], 2, max_ngram=3) == ()  # nothing recurs
    assert prompt_lookup([5], 2) == () and prompt_lookup([1, 2, 1], 0) == ()


@pytest.mark.parametrize("options", [{}, {"num_drafts": 2, "draft_top_k": 2}, {"tree": (2, 2, 1)},
                                     {"draft_schedule": "cost"}])
def test_prompt_lookup_drafts_are_verified_and_decode_exactly(one_thread, options):
    model = random_bpd("llama", 7)
    # a prompt that repeats itself, so the base's greedy continuation tends to copy it
    generator = torch.Generator().manual_seed(11)
    phrase = torch.randint(3, 60, (1, 6), generator=generator)
    ids = torch.cat([phrase] * 4, dim=1)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = model.base_lm.generate(ids, **kwargs)
    got = model.generate(ids, prompt_lookup=True, **options, **kwargs)
    assert torch.equal(got, expected), options
    with_lookup = model.last_generation_stats
    assert with_lookup.method.endswith("+lookup")
    model.generate(ids, prompt_lookup=False, **options, **kwargs)
    without = model.last_generation_stats
    if "draft_schedule" not in options:  # eagerly, the copy is one more path (the cost schedule may cut either)
        assert max(with_lookup.draft_tokens) > max(without.draft_tokens)
    with pytest.raises(BPDConfigError, match="prompt_lookup"):
        model.generate(ids, prompt_lookup="yes", **kwargs)


@pytest.mark.parametrize("compile", [False, True])
def test_a_compiled_chain_shares_its_nodes_with_the_copy(one_thread, compile):
    """The drafter's rule, eager model: with `draft_nodes` (the compiled step's cheap block) the chain and a copy of
    up to `draft_nodes` tokens compete for them, the copy winning where it is likelier to be accepted; the block has
    one length."""
    from hf_bpd.generation.drafting import BlockDrafter

    model = random_bpd("llama", 7)
    drafter = BlockDrafter(model.heads, 3, prompt_lookup=True)
    drafter.calibration = HeadCalibration([1.0], [[0.1]] * 3, lookup=[0.9])  # unreliable heads, reliable copy
    if compile:  # a chain with the copy takes the verifier's cheap block
        drafter.take_cheap_block(4)
    assert drafter.draft_nodes == (3 if compile else None)
    drafter.set_draft_nodes(3 if compile else None)
    hidden = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    context = [5, 6, 7, 8, 9, 5, 6]
    drafts, _ = drafter.drafts(hidden, context, 10)
    if compile:
        assert drafts == [(7, 8, 9)] and drafter.max_block_length() == 4  # the copy took every slot
    else:
        assert drafts[-1] == (7, 8, 9) and len(drafts) == 2 and drafter.max_block_length() == 7
    # 7 slots (a compiled block of 8): the copy may be longer than the chain, and the chain keeps what is left
    long_context = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6]
    drafter.set_draft_nodes(7 if compile else None)
    drafts, _ = drafter.drafts(hidden, long_context, 10)
    if compile:
        assert drafts == [(7, 8, 9, 10, 11, 12, 13)] and drafter.max_block_length() == 8
        drafter.calibration = HeadCalibration([1.0], [[0.95]] * 3, lookup=[0.5])  # now the heads are likelier
        drafts, _ = drafter.drafts(hidden, long_context, 10)
        assert len(drafts) == 2 and len(drafts[0]) == 3 and drafts[1] == (7, 8, 9, 10)  # 3 + 4 = 7 nodes
        assert all(len(d) <= 2 for d in drafter.drafts(hidden, long_context, 2)[0])  # room left in max_length
    else:
        assert drafts[-1] == (7, 8, 9) and len(drafts) == 2  # eagerly: as long as the heads' drafts




def test_best_first_nodes_share_the_chain_slots_by_acceptance_chance():
    from hf_bpd.generation.drafting import best_first_nodes

    heads, copy = (1, 2, 3), (5, 6, 7)
    assert best_first_nodes([(heads, [0.9, 0.8, 0.7]), (copy, [0.5, 0.7, 0.7])], 3) == [heads]
    assert best_first_nodes([(heads, [0.3, 0.8, 0.7]), (copy, [0.5, 0.7, 0.7])], 3) == [(1,), (5, 6)]
    assert best_first_nodes([(heads, [0.6, 0.8, 0.7]), (copy, [0.5, 0.7, 0.7])], 3) == [(1, 2), (5,)]
    # a shared first token is one node: both continuations fit
    assert best_first_nodes([(heads, [0.6, 0.8, 0.7]), ((1, 6, 7), [0.5, 0.7, 0.7])], 3) == [(1, 2), (1, 6)]
    assert best_first_nodes([(heads, [1.0, 1.0, 1.0]), (copy, [1.0, 1.0, 1.0])], 4) == [heads, (5,)]


def test_lookup_records_read_acceptance_off_the_greedy_output():
    from hf_bpd.evaluation.calibration import lookup_records

    # prompt [7, 1, 2, 3, 9], output 1 2 3 4: at each step the copy of "after the last token" is compared with
    # what followed
    sequence = [7, 1, 2, 3, 9, 1, 2, 3, 4]
    stats = GenerationStats(accepted_lengths=[0, 1, 0, 0], draft_tokens=[0, 2, 2, 2])
    # step 1 context ...9 1 -> copy (2, 3) vs truth (2, 3): 2 hits; step 2 context ...1 2 3 -> copy (9, 1) vs (4,):
    # miss; step 3 context ends at 4: nothing recurs, no record
    assert lookup_records(sequence, 5, stats, 2) == [(0, True), (1, True), (0, False)]


# ------------------------------------------------------------------ a budget of draft nodes (`draft_nodes`)
@pytest.mark.parametrize("options", [{"num_drafts": 4, "draft_top_k": 3, "draft_nodes": 5, "prompt_lookup": True},
                                     {"num_drafts": 3, "draft_top_k": 2, "draft_nodes": 2},
                                     {"num_drafts": 1, "draft_nodes": 1, "prompt_lookup": True},
                                     {"num_drafts": 6, "draft_top_k": 4, "draft_nodes": 9, "rescorer": "oracle"}])
def test_draft_nodes_decode_exactly_within_the_budget(one_thread, options):
    """The p-best paths and the copy compete for `draft_nodes` nodes: every step verifies at most that many draft
    tokens, and the output is the base's greedy output."""
    model = random_bpd("llama", 7)
    generator = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.randint(3, 60, (1, 5), generator=generator)] * 3, dim=1)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = model.base_lm.generate(ids, **kwargs)
    call = dict(options)
    if call.get("rescorer") == "oracle":
        call["rescorer"] = OracleRescorer(expected[0].tolist())
    got = model.generate(ids, **call, **kwargs)
    assert torch.equal(got, expected), options
    stats = model.last_generation_stats
    assert max(stats.draft_tokens) <= options["draft_nodes"] and stats.method.endswith(f"/{options['draft_nodes']} nodes")
    if "rescorer" in options:  # the oracle's best path is the truth: with 9 nodes every one of its tokens is verified
        assert stats.block_efficiency > 3.0


def test_draft_nodes_fill_best_first_from_the_p_best_paths(one_thread):
    """The drafter's rule: nodes go to the likeliest tokens, a lower-ranked path's tokens discounted by its measured
    rank factor, so the budget holds the best path and the next path's likeliest branch."""
    from hf_bpd.generation.drafting import BlockDrafter

    model = random_bpd("llama", 7)
    hidden = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    context = [11, 12, 13]
    drafter = BlockDrafter(model.heads, 3, top_k=4, num_drafts=4, draft_nodes=4)
    paths = [d for d in drafter.head_drafts(hidden, context, 10)[0]]
    assert len(paths) == 4 and paths[0] != paths[1]
    drafter.calibration = HeadCalibration([1.0], [[1.0]] * 3)  # every token certain: the best path, then rank 1's
    drafts, _ = drafter.drafts(hidden, context, 10)
    nodes = {d[: j + 1] for d in drafts for j in range(len(d))}
    assert len(nodes) == 4 and paths[0] in drafts and drafter.max_block_length() == 5
    branch = next(d for d in drafts if d != paths[0])
    assert paths[1][: len(branch)] == branch  # the second path's first own node
    drafter.calibration = HeadCalibration([1.0], [[1.0]] * 3, ranks=[0.01])  # lower ranks nearly never accepted
    drafts, _ = drafter.drafts(hidden, context, 10)
    assert drafts[0] == paths[0] and len({d[: j + 1] for d in drafts for j in range(len(d))}) == 4
    assert drafter.calibration.rank_factor(0) == 1.0 and drafter.calibration.rank_factor(5) == 0.01
    assert all(len(d) <= 2 for d in drafter.drafts(hidden, context, 2)[0])  # room left in max_length
    # a budget the paths cannot fill is cut to what they hold (a compiled block is padded to its budget)
    assert BlockDrafter(model.heads, 3, top_k=4, num_drafts=2, draft_nodes=50).max_block_length() == 1 + 6
    assert BlockDrafter(model.heads, 3, top_k=4, num_drafts=2, draft_nodes=50, prompt_lookup=True
                        ).max_block_length() == 51  # the copy can fill it


def test_rank_factors_are_measured_and_saved(one_thread):
    from hf_bpd.evaluation.calibration import rank_records
    from hf_bpd.rescorers.base import HeadScoreRescorer

    records = [(0, 0.95, True)] * 50 + [(0, 0.15, False)] * 50
    ranked = [(1, 0, 0.95, True)] * 30 + [(1, 0, 0.95, False)] * 70 + [(2, 0, 0.95, False)] * 40 + [(0, 0, .95, True)]
    cal = HeadCalibration.fit(records, 1, rank_records=ranked)
    base = cal.rate(0, 0.95)
    assert cal.ranks[0] == pytest.approx((30 + 1) / (100 * base + 2), abs=1e-4) and cal.ranks[1] < 0.05
    assert HeadCalibration.from_dict(json.loads(json.dumps(cal.to_dict()))).ranks == cal.ranks
    with pytest.raises(BPDConfigError, match="rank factors"):
        HeadCalibration([1.0], [[0.5]], ranks=[1.5])
    # teacher-forced records along a greedy output: ranks 0..p-1, only tried tokens, the truth is what follows
    model = random_bpd("llama", 6)
    ids = prompt_ids(2, 6)
    out = model.base_lm.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)[0].tolist()
    got = rank_records(model, out, 6, HeadScoreRescorer(), 3, 4, 5)
    assert got and {r for r, _, _, _ in got} <= set(range(5)) and {h for _, h, _, _ in got} <= {0, 1, 2}
    assert any(ok for *_, ok in got) or all(not ok for *_, ok in got)
    assert all(0 <= p <= 1 for _, _, p, _ in got)
    cal, _ = calibrate(model, [{"input_ids": ids}], max_new_tokens=12, eos_token_id=None)
    assert cal.ranks is not None and len(cal.ranks) == 2


def test_draft_nodes_options_fail_in_one_line(one_thread):
    model = random_bpd("llama", 3)
    ids = prompt_ids(1, 5)
    for bad, match in [(0, "draft_nodes must be"), (10**6, "draft_nodes must be"), ("7", "draft_nodes must be")]:
        with pytest.raises((BPDConfigError, TypeError), match=match):
            model.generate(ids, max_new_tokens=4, draft_nodes=bad)
    with pytest.raises(BPDConfigError, match="tree= fixes the verified nodes"):
        model.generate(ids, max_new_tokens=4, draft_nodes=3, tree=(2, 1))
    # a per-call value wins over the model's generation config
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = model.base_lm.generate(ids, **kwargs)
    try:
        model.generation_config.draft_nodes = 2
        assert torch.equal(model.generate(ids, tree=(2, 1), **kwargs), expected)
        assert model.last_generation_stats.method == "tree"
        assert torch.equal(model.generate(ids, **kwargs), expected)
        assert max(model.last_generation_stats.draft_tokens) <= 2
        model.generation_config.tree = (2, 1)
        assert torch.equal(model.generate(ids, draft_nodes=3, **kwargs), expected)  # the per-call budget
        assert model.last_generation_stats.method.endswith("/3 nodes")
    finally:
        model.generation_config.draft_nodes, model.generation_config.tree = None, None


# ------------------------------------------------------------------ draft_schedule="switch"
def test_the_switch_falls_back_to_plain_steps_and_probes_its_way_back():
    from hf_bpd.generation.controller import PROBE_EVERY, WEIGHT, StepSwitch

    switch = StepSwitch(plain_ms=10.0)
    assert switch.drafting and not switch.probe_due()
    decoded = list(range(100))
    for _ in range(3):  # blocks cost 18 ms and yield one token each: drafting loses
        switch.record(True, 1, 0.018, decoded)
    assert not switch.drafting and switch.switches == 1
    for _ in range(PROBE_EVERY):
        assert not switch.probe_due()
        switch.record(False, 1, 0.010, decoded)
    assert switch.probe_due()
    switch.start_probe([(7, 8, 9, 10)], len(decoded))
    assert not switch.probe_due()  # one shadow draft at a time
    for token in (7, 8, 9, 10):  # the plain steps decode what the shadow draft said: it would have paid
        decoded = decoded + [token]
        switch.record(False, 1, 0.010, decoded)
    assert switch.probe is not None  # scored once the token after the draft is decoded too
    decoded = decoded + [11]
    gain = switch.gain
    switch.record(False, 1, 0.010, decoded)
    assert switch.probe is None and switch.gain == pytest.approx((1 - WEIGHT) * gain + WEIGHT * 5)
    for _ in range(3):  # more such probes: drafting resumes
        for _ in range(PROBE_EVERY):
            switch.record(False, 1, 0.010, decoded)
        if switch.drafting:
            break
        switch.start_probe([(1, 2, 3)], len(decoded))
        decoded = decoded + [1, 2, 3, 4]
        for _ in range(4):
            switch.record(False, 1, 0.010, decoded)
    assert switch.drafting and switch.switches == 2


def test_the_switch_keeps_drafting_where_drafts_pay():
    from hf_bpd.generation.controller import StepSwitch

    switch = StepSwitch(plain_ms=10.0)
    for _ in range(20):
        switch.record(True, 3, 0.018, list(range(10)))
    assert switch.drafting and switch.switches == 0


def test_one_slow_step_does_not_lock_the_switch_out_of_drafting():
    from hf_bpd.generation.controller import WEIGHT, StepSwitch

    switch = StepSwitch(plain_ms=10.0)
    switch.record(True, 4, 0.500, list(range(10)))  # the call's first drafted step: one-off costs, not timed
    assert switch.draft_ms is None and switch.drafting
    switch.record(True, 4, 0.015, list(range(10)))
    switch.record(True, 4, 0.300, list(range(10)))  # a stall counts as twice the average at most
    assert switch.draft_ms == pytest.approx((1 - WEIGHT) * 15 + WEIGHT * 30) and switch.drafting and switch.switches == 0
    for _ in range(6):  # slow steps that persist are learned
        switch.record(True, 1, 0.060, list(range(10)))
    assert not switch.drafting


def test_a_stale_plain_cost_is_capped_by_the_drafted_steps():
    from hf_bpd.generation.controller import StepSwitch

    switch = StepSwitch(plain_ms=50.0)  # a one-token cost measured when the machine was busy
    for _ in range(4):  # drafted steps of 10 ms, 4 of them drafting, one token each: a plain step costs <= 6 ms
        switch.record(True, 1, 0.010, list(range(10)), drafting_seconds=0.004)
    assert switch.plain_ms == pytest.approx(6.0) and not switch.drafting


@pytest.mark.parametrize("options", [{}, {"rescorer": "oracle"}, {"tree": (2, 2, 1)}, {"prompt_lookup": True}])
def test_switch_schedule_decodes_exactly(one_thread, options):
    """Random heads draft badly: the call falls back to plain steps (and still drafts now and then); the oracle's
    drafts pay: the call drafts (a stall may cost a few plain steps). The tokens are the base's either way."""
    from hf_bpd.generation.controller import PROBE_EVERY

    plain_steps = []
    for stats in schedule_runs("switch", options, 40):
        assert stats.plain_steps == sum(1 for n in stats.draft_tokens[1:] if n == 0)
        plain_steps.append(stats.plain_steps)
    if options.get("rescorer") == "oracle":  # timing noise may cost a few plain steps, never a lock-out (~30)
        assert max(plain_steps) <= PROBE_EVERY, plain_steps
    elif not options.get("prompt_lookup"):  # (a random base repeats itself: copies of it may pay, so no claim)
        assert min(plain_steps) > 0
