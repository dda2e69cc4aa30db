"""BPD inside generate(): token-for-token equality with the base's own greedy generate(), statistics, edge cases."""

import functools
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM, BPDConfigError, Rescorer, sparse_tree
from hf_bpd.lattice import Draft
from tests.conftest import ARCHS, VOCAB, tiny_base

MODES = {
    "chain": {},
    "pbest": {"num_drafts": 4, "draft_top_k": 3},
    "tree": {"tree": sparse_tree((3, 2, 2))},
}


@functools.lru_cache(maxsize=None)
def random_bpd(arch: str, seed: int, num_heads: int = 3):
    """A tiny base with random (hence often wrong) heads: drafts get accepted and rejected."""
    model = BlockwiseParallelForCausalLM.from_base(tiny_base(arch), num_heads=num_heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval()


def prompt_ids(seed: int, length: int):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


class OracleRescorer(Rescorer):
    """Test rescorer that knows the base's greedy continuation; `wrong_at` corrupts the draft from that position.

    It makes acceptance predictable, so block efficiency and early stops inside accepted drafts can be checked.
    With `decoys`, extra wrong drafts are returned first, so tree verification must find the right branch.
    """

    def __init__(self, reference: list[int], wrong_at: int | None = None, decoys: int = 0):
        self.reference, self.wrong_at, self.decoys = reference, wrong_at, decoys

    def rescore(self, lattice, context, num_drafts):
        n = lattice.num_heads
        truth = list(self.reference[len(context): len(context) + n])
        truth += [3] * (n - len(truth))
        if self.wrong_at is not None and self.wrong_at < n:
            truth[self.wrong_at] = (truth[self.wrong_at] + 1) % VOCAB
        decoys = [tuple((t + 1 + d) % VOCAB for t in truth) for d in range(self.decoys)]
        return [Draft(d, 0.0) for d in decoys] + [Draft(tuple(truth), 0.0)]


# ------------------------------------------------------------------ greedy exactness
@settings(max_examples=330, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    arch=st.sampled_from(ARCHS),
    mode=st.sampled_from(sorted(MODES)),
    head_seed=st.integers(0, 3),
    prompt_seed=st.integers(0, 10_000),
    prompt_length=st.integers(1, 24),
    max_new_tokens=st.integers(1, 28),
    num_heads_to_use=st.integers(1, 3),
    processors=st.sampled_from(["none", "repetition_penalty", "no_repeat_ngram"]),
)
def test_greedy_equals_base_generate(arch, mode, head_seed, prompt_seed, prompt_length, max_new_tokens,
                                     num_heads_to_use, processors):
    model = random_bpd(arch, head_seed)
    ids = prompt_ids(prompt_seed, prompt_length)
    extra = {"none": {}, "repetition_penalty": {"repetition_penalty": 1.3},
             "no_repeat_ngram": {"no_repeat_ngram_size": 2}}[processors]
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, **extra)
    expected = model.base_lm.generate(ids, **kwargs)
    options = dict(MODES[mode])
    if "tree" in options:
        options["tree"] = [c for c in options["tree"] if len(c) <= num_heads_to_use]
    got = model.generate(ids, num_heads_to_use=num_heads_to_use, **options, **kwargs)
    assert torch.equal(got, expected), f"{arch} {mode}: {got.tolist()} != {expected.tolist()}"
    stats = model.last_generation_stats
    assert stats.new_tokens == got.shape[1] - ids.shape[1]
    assert stats.serial_calls == stats.new_tokens - sum(stats.accepted_lengths)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_with_eos_and_long_context(arch, mode):
    """Long generations (past Gemma3's tiny sliding window) with an EOS that the base eventually emits."""
    model = random_bpd(arch, 7)
    ids = prompt_ids(11, 6)
    free = model.base_lm.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 30])
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = model.base_lm.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **MODES[mode], **kwargs), expected)


# ------------------------------------------------------------------ stops inside an accepted block
def reference_and_model(arch="llama", new=30):
    model = random_bpd(arch, 1)
    ids = prompt_ids(5, 5)
    reference = model.base_lm.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None)[0].tolist()
    return model, ids, reference


@pytest.mark.parametrize("mode", ["chain", "pbest", "tree"])
def test_eos_inside_an_accepted_draft(mode):
    model, ids, reference = reference_and_model()
    # an EOS the oracle drafts in the middle of a block that is accepted whole
    eos = reference[ids.shape[1] + 6]
    first = reference.index(eos, ids.shape[1])
    options = {"chain": {}, "pbest": {"num_drafts": 3}, "tree": {"num_drafts": 3}}[mode]
    rescorer = OracleRescorer(reference, decoys=0 if mode == "chain" else 2)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = model.base_lm.generate(ids, **kwargs)
    got = model.generate(ids, rescorer=rescorer, draft_top_k=2, **options, **kwargs)
    assert torch.equal(got, expected)
    assert got.shape[1] == first + 1 and got[0, -1] == eos
    assert max(model.last_generation_stats.accepted_lengths) == 3  # whole blocks were accepted


@pytest.mark.parametrize("mode", ["chain", "pbest"])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_max_new_tokens_smaller_than_a_block(mode, max_new_tokens):
    model, ids, reference = reference_and_model()
    options = {"chain": {}, "pbest": {"num_drafts": 2}}[mode]
    got = model.generate(ids, rescorer=OracleRescorer(reference), draft_top_k=2, max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, **options)
    assert got[0].tolist() == reference[: ids.shape[1] + max_new_tokens]
    assert model.last_generation_stats.new_tokens == max_new_tokens


class StopAfterToken(StoppingCriteria):
    """Stops as soon as `token` has been generated `count` times (a criterion that fires mid-block)."""

    def __init__(self, token, prompt_length, count=1):
        self.token, self.prompt_length, self.count = token, prompt_length, count

    def __call__(self, input_ids, scores, **kwargs):
        hits = (input_ids[:, self.prompt_length:] == self.token).sum(-1)
        return hits >= self.count


@pytest.mark.parametrize("mode", ["chain", "pbest", "tree"])
def test_stopping_criterion_mid_block(mode):
    model, ids, reference = reference_and_model()
    stop_token = reference[ids.shape[1] + 9]
    criteria = StoppingCriteriaList([StopAfterToken(stop_token, ids.shape[1])])
    expected = model.base_lm.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                                      stopping_criteria=criteria)
    options = {"chain": {}, "pbest": {"num_drafts": 3}, "tree": {"num_drafts": 2}}[mode]
    streamed = []

    class Collect:
        def put(self, value):
            streamed.extend(value.reshape(-1).tolist())

        def end(self):
            streamed.append("end")

    criteria = StoppingCriteriaList([StopAfterToken(stop_token, ids.shape[1])])
    got = model.generate(ids, rescorer=OracleRescorer(reference, decoys=1), draft_top_k=2, max_new_tokens=30,
                         do_sample=False, eos_token_id=None, stopping_criteria=criteria, streamer=Collect(),
                         **options)
    assert torch.equal(got, expected)
    # the streamer saw the prompt, then exactly the generated tokens, then the end
    assert streamed == got[0].tolist() + ["end"]


# ------------------------------------------------------------------ block efficiency on constructed cases
def constant_gpt2():
    """A GPT-2 whose final LayerNorm has weight 0 and bias b: every position's hidden state is b, so the base (and
    every fresh, identity-initialised head) always predicts the same token: the heads copy the base perfectly."""
    base = tiny_base("gpt2")
    with torch.no_grad():
        base.transformer.ln_f.weight.zero_()
        base.transformer.ln_f.bias.copy_(torch.linspace(-1, 1, base.config.n_embd))
    return base


@pytest.mark.parametrize("h", [1, 2, 4])
@pytest.mark.parametrize("mode", ["chain", "pbest", "tree"])
def test_block_efficiency_with_heads_that_copy_the_base(h, mode):
    base = constant_gpt2()
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=h)
    ids = prompt_ids(0, 4)
    steps = 6
    new = 1 + steps * (h + 1)  # the prompt pass decodes 1 token, then every call accepts h drafts + 1 token
    options = {"chain": {}, "pbest": {"num_drafts": 3}, "tree": {"tree": sparse_tree((2,) * h)}}[mode]
    got = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, **options)
    assert torch.equal(got, base.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None))
    stats = model.last_generation_stats
    assert stats.accepted_lengths == [0] + [h] * steps
    assert stats.mean_accepted == h  # every verification call: h + 1 tokens
    assert stats.serial_calls == steps + 1
    assert stats.block_efficiency == pytest.approx(new / (steps + 1))
    assert stats.block_efficiency == pytest.approx(1 + sum(stats.accepted_lengths) / stats.serial_calls)


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_block_efficiency_with_known_partial_acceptance(wrong_at):
    model, ids, reference = reference_and_model(new=25)
    got = model.generate(ids, rescorer=OracleRescorer(reference, wrong_at=wrong_at), draft_top_k=2,
                         max_new_tokens=25, do_sample=False, eos_token_id=None)
    assert got[0].tolist() == reference
    stats = model.last_generation_stats
    # each verification call accepts exactly `wrong_at` draft tokens (the last may be capped by max_new_tokens)
    assert set(stats.accepted_lengths[1:-1]) == {wrong_at}
    assert stats.block_efficiency == pytest.approx(25 / stats.serial_calls)
    assert stats.serial_calls == 1 + -(-24 // (wrong_at + 1))


def test_plain_decoding_has_block_efficiency_one():
    model = random_bpd("qwen2", 0)
    model.generate(prompt_ids(1, 5), max_new_tokens=9, do_sample=False, eos_token_id=None, use_heads=False)
    stats = model.last_generation_stats
    assert stats.block_efficiency == 1.0 and stats.serial_calls == 9 and stats.method == "plain"


def test_stats_record_time_and_draft_sizes():
    model = random_bpd("llama", 0)
    model.generate(prompt_ids(1, 5), max_new_tokens=12, do_sample=False, eos_token_id=None, num_drafts=3,
                   draft_top_k=2)
    stats = model.last_generation_stats.as_dict()
    assert stats["method"] == "p-best" and stats["draft_seconds"] > 0 and stats["verifier"] == "eager"
    assert stats["total_seconds"] >= stats["draft_seconds"] + stats["verify_seconds"] - 1e-9
    assert len(stats["draft_tokens"]) == stats["serial_calls"] and max(stats["draft_tokens"]) > 3


def test_return_dict_scores_match_base():
    model = random_bpd("llama", 2)
    ids = prompt_ids(3, 6)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                  output_scores=True)
    expected = model.base_lm.generate(ids, **kwargs)
    for options in ({}, {"num_drafts": 3}):
        got = model.generate(ids, **options, **kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        assert len(got.scores) == len(expected.scores) == 10
        for a, b in zip(got.scores, expected.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)



def test_the_kv_cache_goes_by_the_installed_transformers_name(caplog):
    """transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` and warns on the old
    name: hf_bpd passes and returns it under the installed version's name, so no path warns (and 5.23 still works)."""
    import transformers.modeling_outputs
    from transformers.utils import logging as hf_logging

    from hf_bpd.heads import CACHE_NAME

    fields = transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
    assert CACHE_NAME == ("cache" if "cache" in fields else "past_key_values")
    model = random_bpd("llama", 2)
    ids = prompt_ids(3, 6)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(ids, use_cache=True)
            assert out[CACHE_NAME].get_seq_length() == 6
            again = model(ids[:, -1:], use_cache=True, **{CACHE_NAME: out[CACHE_NAME]})
            assert again[CACHE_NAME].get_seq_length() == 7
            for options in ({}, {"num_drafts": 3}, {"use_heads": False}):
                got = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, **options)
                assert got[CACHE_NAME] is None or got[CACHE_NAME].get_seq_length() >= 6
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text  # ModelOutput's rename
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    with pytest.raises(BPDConfigError, match="pass the KV cache once"):
        model(ids, cache=out[CACHE_NAME], past_key_values=out[CACHE_NAME])


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"draft_top_k": 0}, "draft_top_k must be an integer in [1, 64]"),
        ({"draft_top_k": VOCAB + 1}, "draft_top_k must be an integer in [1, 64]"),
        ({"num_drafts": 0}, "num_drafts must be an integer in [1, 64]"),
        ({"num_drafts": 5000}, "num_drafts must be an integer in [1, 64]"),
        ({"tree": "4,x"}, "comma-separated top-k widths"),
        ({"tree": (64, 64, 64)}, "over the ceiling of 256"),
        ({"num_heads_to_use": 4}, "num_heads_to_use must be an integer in [1, 3]"),
        ({"rescorer": "bigram"}, "unknown rescorer 'bigram'"),
        ({"use_heads": False, "rescorer": "ngram"}, "use_heads=False decodes without drafting"),
        ({"use_heads": False, "num_drafts": 2}, "num_drafts would be ignored"),
        ({"rescorer": "ngram"}, "bundles no ngram rescorer"),
        ({"tree": [(0, 0)]}, "has no parent (0,)"),
        ({"tree": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]}, "deeper than the 3 heads"),
        ({"cache_implementation": "static"}, "drafting needs a dynamic KV cache"),
        ({"num_beams": 2}, "beam search cannot be combined"),
        ({"prompt_lookup_num_tokens": 3}, "another drafting method"),
        ({"use_cache": False}, "drafting needs use_cache=True: drop use_cache=False, or pass use_heads=False"),
    ],
)
def test_bad_generate_arguments_are_one_line_errors(kwargs, fragment):
    model = random_bpd("llama", 0)
    with pytest.raises(BPDConfigError) as err:
        model.generate(prompt_ids(0, 4), max_new_tokens=4, **kwargs)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_assistant_model_and_inputs_embeds_are_one_line_errors():
    model = random_bpd("llama", 0)
    with pytest.raises(BPDConfigError, match="assistant_model replaces the drafting loop: pass use_heads=False"):
        model.generate(prompt_ids(0, 4), max_new_tokens=4, assistant_model=model.base_lm)
    embeds = model.base_lm.get_input_embeddings()(prompt_ids(0, 4))
    with pytest.raises(BPDConfigError, match=r"pass input_ids, or .* model.base_lm.generate\(inputs_embeds=...\)"):
        model.generate(inputs_embeds=embeds, max_new_tokens=4)


@pytest.mark.parametrize("kwargs", [
    {"num_beams": 2}, {"prompt_lookup_num_tokens": 2}, {"use_cache": False}, {"cache_implementation": "static"},
    {"output_hidden_states": True, "return_dict_in_generate": True}, {"assistant_model": "base"},
], ids=["beams", "prompt-lookup", "no-cache", "static-cache", "hidden-states", "assistant"])
def test_use_heads_false_runs_what_only_transformers_loop_runs(kwargs):
    """What the drafting errors advise (`use_heads=False`) works with a checkpoint that compiles by default: the call
    runs the base's own `generate()` (its loop, uncompiled) and returns what the base returns."""
    model = random_bpd("llama", 0)
    model.generation_config.compile = True  # as the shipped checkpoints set it
    kwargs = {k: model.base_lm if v == "base" else v for k, v in kwargs.items()}
    ids, settings = prompt_ids(0, 4), dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    got = model.generate(ids, use_heads=False, **settings, **kwargs)
    expected = model.base_lm.generate(ids, **settings, **kwargs)
    assert model.last_generation_stats.method == "plain"
    if kwargs.get("return_dict_in_generate"):
        assert len(got.hidden_states) == len(expected.hidden_states) == 6
        got, expected = got.sequences, expected.sequences
    assert torch.equal(got, expected)


def test_a_batch_drafts_and_matches_batched_plain_decoding():
    """Batches draft (tests/test_batch.py has the row-by-row exactness); without padding, rows equal transformers'
    batched plain decoding of the same batch."""
    model = random_bpd("llama", 0)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    drafted = model.generate(ids, max_new_tokens=4, eos_token_id=None)
    assert drafted.shape == (2, 9) and model.last_generation_stats.method == "chain/cost-aware+batch"
    assert torch.equal(drafted, model.generate(ids, max_new_tokens=4, eos_token_id=None, use_heads=False))


def test_rescorer_hook_receives_the_lattice_and_context():
    seen = []

    class Spy(Rescorer):
        def rescore(self, lattice, context, num_drafts):
            seen.append((tuple(lattice.tokens.shape), len(context), num_drafts))
            return lattice.best_paths(num_drafts)

    model = random_bpd("llama", 0)
    ids = prompt_ids(0, 4)
    expected = model.base_lm.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    got = model.generate(ids, rescorer=Spy(), draft_top_k=5, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(got, expected)
    assert seen[0] == ((3, 5), 5, 1)  # 3 heads x top-5, context = prompt + the base's first token
    assert hf_bpd.Lattice is type(hf_bpd.Lattice(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1)))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("options", [{}, {"num_drafts": 3}], ids=["chain", "pbest"])
def test_drafts_come_from_the_hidden_state_of_the_last_decoded_token(arch, options):
    """Every lattice equals the heads applied to a fresh, cache-free forward pass over the context."""
    model = random_bpd(arch, 3)
    checked = []

    class Check(Rescorer):
        def rescore(self, lattice, context, num_drafts):
            with torch.no_grad():
                hidden = model(torch.tensor([context[:-1]]), return_head_logits=False).last_hidden_state[0, -1]
                logits = model.heads.step_logits(hidden, lattice.num_heads)
            expected = torch.log_softmax(logits.float(), -1).topk(lattice.k, dim=-1)
            torch.testing.assert_close(lattice.logprobs, expected.values, rtol=1e-4, atol=1e-4)
            checked.append(len(context))
            return lattice.best_paths(num_drafts)

    ids = prompt_ids(9, 7)
    expected = model.base_lm.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    got = model.generate(ids, rescorer=Check(), draft_top_k=4, max_new_tokens=20, do_sample=False,
                         eos_token_id=None, **options)
    assert torch.equal(got, expected)
    assert len(checked) >= 5


def test_lattice_token_probs_per_head():
    from hf_bpd.lattice import Lattice

    tokens = torch.tensor([[5, 7, 9], [7, 5, 5]])
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]))
    lattice = Lattice(tokens, logprobs)
    assert lattice.token_probs((7, 5)) == pytest.approx([0.3, 0.2])  # a repeated token: its best rank
    assert lattice.token_probs((4, 7, 9)) == pytest.approx([0.0, 0.6])  # outside the top-k: 0; one per head
    assert lattice.token_probs(torch.tensor([9, 5]).tolist()) == pytest.approx([0.1, 0.2])
