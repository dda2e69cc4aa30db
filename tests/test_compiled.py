"""`generate(compile=True)`: the compiled verification step on a reused static cache, exact and with fallbacks.

Compiling costs tens of seconds per block shape even for a tiny model, so one model and few shapes are used.
"""

import copy
import warnings

import pytest
import torch

from hf_bpd.runtime import compiled as verify_runtime
from tests.conftest import VOCAB
from tests.test_decoding import random_bpd

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def prompt(seed: int, length: int):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model(one_thread):
    return random_bpd("llama", 2)


@pytest.mark.parametrize("options", [{}, {"tree": (2, 2, 1)}, {"num_drafts": 3, "draft_top_k": 2},
                                     {"num_drafts": 3, "draft_top_k": 2, "draft_nodes": 3, "prompt_lookup": True},
                                     {"use_heads": False}, {"heads_int8": False}],
                         ids=["chain", "tree", "pbest", "nodes", "plain", "chain-fp32-heads"])
def test_compiled_decoding_equals_the_base_greedy_output(model, options):
    for seed in range(4):
        ids = prompt(seed, 3 + 4 * seed)
        kwargs = dict(max_new_tokens=18 + seed, do_sample=False, eos_token_id=None)
        expected = model.base_lm.generate(ids, **kwargs)
        got = model.generate(ids, compile=True, **options, **kwargs)
        assert torch.equal(got, expected), (options, seed)
        stats = model.last_generation_stats
        assert stats.new_tokens == got.shape[1] - ids.shape[1]
        assert stats.method == ("plain-compiled" if options.get("use_heads") is False else stats.method)
        assert stats.verifier == "compiled" and stats.as_dict()["verifier"] == "compiled"
        if "draft_nodes" in options:  # the paths and the copy share the compiled block of 4 the chain uses
            assert max(stats.draft_tokens) <= 3 and stats.method == "p-best+lookup/3 nodes"
    # the steps compiled once: later calls pay nothing
    assert model.last_generation_stats.compile_seconds == 0.0
    runner = next(iter(verify_runtime._RUNNERS[model.base_lm].values()))
    assert set(runner.compiled_buckets) <= {1, 4, 7, 10, 11}
    if options.get("heads_int8") is False:  # the heads step compiled too
        assert runner.compiled_heads
    elif options.get("use_heads") is not False:  # on a CPU the heads step is the int8 kernel's (heads_int8=None)
        from hf_bpd.runtime.int8_heads import _STEPS

        assert model.heads in _STEPS


def test_a_growing_conversation_reuses_the_cached_context_and_stays_exact(model):
    """Each call keeps the prompt's prefix the static cache holds from the last call (the last answer included) and
    runs only the rest; a prompt that leaves the cached context early keeps only the common part."""
    # (no padding id: an answer holding token 0 would otherwise make the next prompt look padded)
    kwargs = dict(max_new_tokens=14, do_sample=False, eos_token_id=None, pad_token_id=None)
    ids = prompt(40, 5)
    for turn in range(3):
        for options in ({}, {"use_heads": False}):  # drafting and compiled plain share the runner and its cache
            got = model.generate(ids, compile=True, **options, **kwargs)
            assert torch.equal(got, model.base_lm.generate(ids, **kwargs)), (turn, options)
            reused = model.last_generation_stats.reused_prompt_tokens
            if turn > 0 or options:  # the same prompt twice: all but its last token; a new turn: the old context
                assert reused >= ids.shape[1] - 6, (turn, options, reused)
        ids = torch.cat([got, prompt(41 + turn, 5)], 1)
    changed = ids.clone()
    changed[0, 7] = 3 + (changed[0, 7] - 2) % (VOCAB - 3)  # the context differs from token 7 on (no special ids)
    got = model.generate(changed, compile=True, **kwargs)
    assert torch.equal(got, model.base_lm.generate(changed, **kwargs))
    assert model.last_generation_stats.reused_prompt_tokens == 7
    # a call that outgrows the 512-slot cache takes a larger one, and the context moves with it
    longer = torch.cat([got, prompt(50, 4)], 1)
    kwargs["max_new_tokens"] = 520
    assert torch.equal(model.generate(longer, compile=True, **kwargs), model.base_lm.generate(longer, **kwargs))
    assert model.last_generation_stats.reused_prompt_tokens >= longer.shape[1] - 5
    assert max(size for _, size in verify_runtime._RUNNERS[model.base_lm]) >= 1024
    # a new short conversation on the 512-slot cache, continued with a long answer: its context moves into the
    # larger cache that already exists (and holds an older conversation)
    short, kwargs["max_new_tokens"] = prompt(60, 5), 14
    got = model.generate(short, compile=True, **kwargs)
    assert torch.equal(got, model.base_lm.generate(short, **kwargs))
    again, kwargs["max_new_tokens"] = torch.cat([got, prompt(61, 4)], 1), 520
    assert torch.equal(model.generate(again, compile=True, **kwargs), model.base_lm.generate(again, **kwargs))
    assert model.last_generation_stats.reused_prompt_tokens >= again.shape[1] - 5


def test_compiled_cost_schedule_and_prompt_lookup_are_exact(model):
    """The cost schedule uses the compiled one-token and chain steps and their timed costs; a prompt-lookup copy
    competes with the chain for the 7 draft nodes of one compiled block of 8."""
    for seed, options in enumerate([{"draft_schedule": "cost"}, {"prompt_lookup": True},
                                    {"prompt_lookup": True, "draft_schedule": "cost"}]):
        phrase = prompt(20 + seed, 4)
        ids = torch.cat([phrase, prompt(30 + seed, 3), phrase], dim=1)  # something to look up
        kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
        assert torch.equal(model.generate(ids, compile=True, **options, **kwargs),
                           model.base_lm.generate(ids, **kwargs)), options
    runner = next(iter(verify_runtime._RUNNERS[model.base_lm].values()))
    assert {1, 4} <= set(runner.bucket_ms) and min(runner.bucket_ms.values()) > 0
    assert 1 + verify_runtime.COMPILED_DRAFT_SLOTS in runner.bucket_ms  # the chain and the copy share a block of 8


def test_compiled_stops_and_sampling_settings(model):
    ids = prompt(9, 5)
    free = model.base_lm.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 7])
    for kwargs in (dict(eos_token_id=eos, pad_token_id=0), dict(eos_token_id=None, repetition_penalty=1.3),
                   dict(eos_token_id=None, do_sample=True, top_k=1)):
        kwargs = dict(max_new_tokens=20, **kwargs)
        kwargs.setdefault("do_sample", False)
        assert torch.equal(model.generate(ids, compile=True, **kwargs), model.base_lm.generate(ids, **kwargs))


def test_compiled_near_ties_go_to_the_eager_referee(model):
    """Compiled kernels round differently from the eager base; with a margin every token is inside of, each is
    decided by the referee, whose logits are the eager generate()'s bit for bit (repetition penalty included)."""
    for seed, options in enumerate([{}, {"use_heads": False}]):
        ids = prompt(40 + seed, 6)
        kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, repetition_penalty=1.2,
                      output_logits=True, output_scores=True, return_dict_in_generate=True)
        alone = model.base_lm.generate(ids, **kwargs)
        got = model.generate(ids, compile=True, tie_margin=1e9, **options, **kwargs)
        assert torch.equal(got.sequences, alone.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, alone.logits))
        assert all(torch.equal(a, b) for a, b in zip(got.scores, alone.scores))
        assert got.generation_stats.tie_checks == 16


def hybrid_gemma3(seed: int = 0):
    """A tiny Gemma 3 with both layer types (sliding, full, sliding), a window of 8 tokens and logit soft-capping."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from hf_bpd import BlockwiseParallelForCausalLM

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              bos_token_id=1, eos_token_id=2, pad_token_id=0, final_logit_softcapping=30.0)
    torch.manual_seed(seed)
    model = BlockwiseParallelForCausalLM.from_base(AutoModelForCausalLM.from_config(config).eval(), num_heads=3)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval()


@pytest.mark.parametrize("options", [{}, {"tree": (2, 2, 1)}, {"use_heads": False}],
                         ids=["chain", "tree", "plain"])
def test_sliding_window_bases_decode_compiled_and_exactly(options, one_thread):
    """Gemma 3's hybrid layout on the compiled step: every layer keeps every position, the sliding layers' mask
    closes what their window no longer reaches. Contexts of 13-43 tokens outgrow the window of 8 many times over (a
    step without the window changes these outputs)."""
    model = hybrid_gemma3()
    for seed in range(2):
        ids = prompt(seed, 3 + 10 * seed)
        kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model.generate(ids, compile=True, **options, **kwargs)
        assert not [w for w in caught if "compile=True is not used" in str(w.message)]
        assert model.last_generation_stats.verifier == "compiled"
        assert torch.equal(got, model.base_lm.generate(ids, **kwargs)), (options, seed)


def test_layer_types_without_a_compiled_step_are_named(one_thread):
    from hf_bpd.runtime.step import compile_unsupported_reason

    model = hybrid_gemma3()
    assert compile_unsupported_reason(model.base_lm) is None
    model.base_lm.config.layer_types = ["sliding_attention", "chunked_attention", "sliding_attention"]
    assert compile_unsupported_reason(model.base_lm) == "its chunked_attention layers have no compiled step"
    model.base_lm.config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    model.base_lm.config.sliding_window = None
    assert compile_unsupported_reason(model.base_lm) == "its sliding-window layers name no window"


def test_a_failing_compiler_falls_back_to_eager(monkeypatch, one_thread):
    model = random_bpd("qwen2", 1)
    monkeypatch.setattr(verify_runtime, "INDUCTOR_OPTIONS", {"no_such_inductor_option": True})
    ids = prompt(2, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, compile=True)
    assert torch.equal(got, model.base_lm.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None))
    assert any("compiling failed" in str(w.message) for w in caught)
    assert model.base_lm not in verify_runtime._RUNNERS


def test_cost_model_measures_eager_and_compiled_steps(model):
    """The compiled length 4 is the chain step compiled above (same runner): no new compilation."""
    from hf_bpd.runtime import cost

    costs = cost.measure_costs(model.base_lm, [1, 4], compiled=True, past=20, repeats=3)
    assert len(costs["eager_ms"]) == len(costs["compiled_ms"]) == 2 and min(costs["compiled_ms"]) > 0
    assert costs["bound_ms"] > 0 and costs["bandwidth_gb_s"] > 0.1
    table = cost.cost_table(costs)
    assert "| 4 |" in table and "bound" in table


def test_a_fresh_runner_compiles_each_block_length_once(one_thread):
    """The static cache is allocated before compiling: no second compilation for the allocated cache."""
    from torch._dynamo.utils import counters

    model = copy.deepcopy(random_bpd("qwen2", 2))  # a base no graph was compiled for (graphs are kept per base)
    runner = verify_runtime.compiled_runner(model.base_lm, 64)
    before = counters["stats"]["unique_graphs"]
    runner.warm_up([3], torch.device("cpu"))
    assert counters["stats"]["unique_graphs"] - before == 1
    assert set(runner.bucket_ms) == {3}
    verify_runtime._RUNNERS.pop(model.base_lm, None)


def test_compiled_hydra_heads_step_and_decoding_are_exact(model):
    """Sequential (hydra) heads on the same base: the compiled heads step (each head reads the previous head's
    argmax inside the graph) gives the eager drafting lattice, and compiled decoding stays exact."""
    from hf_bpd import BlockwiseParallelForCausalLM

    hydra = BlockwiseParallelForCausalLM.from_base(model.base_lm, num_heads=3, head_type="hydra",
                                                   head_intermediate_size=48)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in hydra.heads.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    hydra.eval()
    runner = next(iter(verify_runtime._RUNNERS[model.base_lm].values()))
    step = runner.heads_step(hydra.heads, 16)
    hidden = torch.randn(hydra.config.hidden_size, generator=generator)
    with torch.no_grad():
        values, indices = step(hidden, 11)
        eager = hydra.heads.step_logits(hidden, 3, 11).float().log_softmax(-1).topk(16, dim=-1)
    assert torch.equal(indices[:, 0], eager.indices[:, 0])
    torch.testing.assert_close(values, eager.values, rtol=1e-4, atol=1e-4)
    for seed in range(3):
        ids = prompt(40 + seed, 4 + 3 * seed)
        kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
        for options in ({}, {"prompt_lookup": True}):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = hydra.generate(ids, compile=True, **options, **kwargs)
            assert torch.equal(got, model.base_lm.generate(ids, **kwargs)), (seed, options)
            # heads_int8=None (the default) falls back to the compiled heads step silently
            assert not [w for w in caught if "heads_int8" in str(w.message)], [str(w.message) for w in caught]


def test_two_models_of_one_shape_each_run_their_own_compiled_step(one_thread):
    """Two bases of the same architecture and shapes but different weights, compiled in one process: each call runs
    its own model's frozen graph (dynamo caches graphs per code object, so a guard filter that drops the modules'
    guards let the second model run the first one's weights)."""
    from transformers import AutoModelForCausalLM

    from hf_bpd import BlockwiseParallelForCausalLM
    from tests.conftest import TINY_CONFIGS

    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        models.append(BlockwiseParallelForCausalLM.from_base(
            AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]()).eval(), num_heads=2).eval())
    ids = prompt(7, 6)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    outputs = []
    for m in models + models[::-1]:
        got = m.generate(ids, compile=True, use_heads=False, **kwargs)
        assert torch.equal(got, m.base_lm.generate(ids, **kwargs))
        outputs.append(got)
    assert not torch.equal(outputs[0], outputs[1])  # the two models do decode differently


def test_compiled_switch_schedule_is_exact(model):
    """`draft_schedule="switch"` runs plain steps through the compiled one-token step and drafted ones through the
    block step, both warmed and timed up front."""
    for seed in range(2):
        ids = prompt(40 + seed, 6)
        kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert torch.equal(model.generate(ids, compile=True, draft_schedule="switch", **kwargs),
                           model.base_lm.generate(ids, **kwargs))
    runner = next(iter(verify_runtime._RUNNERS[model.base_lm].values()))
    assert 1 in runner.bucket_ms and runner.bucket_ms[1] > 0


def test_half_precision_calls_recompute_their_prompt(one_thread):
    """bf16 rounds a prompt token's keys and values differently in another call's prompt pass, so a compiled call
    never reuses the last call's context there: the same call gives the same tokens whatever ran before it."""
    import copy

    model = copy.deepcopy(random_bpd("llama", 6)).to(torch.bfloat16)
    ids = prompt(70, 9)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, compile=True)
    first = model.generate(ids, **kwargs)
    model.generate(torch.cat([ids, prompt(71, 3)], 1), **kwargs)  # a longer prompt sharing the first's tokens
    assert model.last_generation_stats.reused_prompt_tokens == 0
    assert torch.equal(model.generate(ids, **kwargs), first)
    assert model.last_generation_stats.reused_prompt_tokens == 0
    verify_runtime.discard_runners(model.base_lm)


def test_a_second_base_of_the_same_shape_gets_its_own_graph(one_thread):
    """dynamo keeps graphs per code object, and the compiled steps drop most module guards (`step_guards`): the
    identity checks they keep must still tell two bases of one shape apart, or the second would run the first's
    frozen weights."""
    from tests.test_decoding import prompt_ids

    first = copy.deepcopy(random_bpd("llama", 5))
    second = copy.deepcopy(first)
    with torch.no_grad():
        for p in second.base_lm.parameters():
            p.mul_(-1.5)
    ids = prompt_ids(3, 9)
    outputs = []
    for model in (first, second):
        got = model.generate(ids, use_heads=False, compile=True, do_sample=False, max_new_tokens=12,
                             eos_token_id=None)
        assert model.last_generation_stats.verifier == "compiled"
        expected = model.base_lm.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None,
                                          pad_token_id=0)
        assert torch.equal(got, expected)
        outputs.append(got)
        verify_runtime.discard_runners(model.base_lm)
    assert not torch.equal(outputs[0], outputs[1])


def test_a_base_whose_weights_changed_gets_new_runners(one_thread):
    """Compiled runners freeze the weights into their graphs: after a write through `.data` (which bumps no version)
    the base's next call gets a fresh runner, not one compiled for the old weights."""
    model = copy.deepcopy(random_bpd("qwen2", 2))
    base = model.base_lm
    runner = verify_runtime.compiled_runner(base, 64)
    assert verify_runtime.compiled_runner(base, 64) is runner
    with torch.no_grad():
        base.model.layers[0].mlp.up_proj.weight.data.add_(0.5)
    assert verify_runtime.compiled_runner(base, 64) is not runner
    verify_runtime._RUNNERS.pop(base, None)
