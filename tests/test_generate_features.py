"""The one generate() route: transformers' generate() features behave with drafting exactly as without it.

A tiny Llama with SmolLM2's real tokenizer and vocabulary (so stop strings and pipelines are real). Each feature runs
plainly (`use_heads=False`) and with every drafting shape; drafts come either from the random heads (mostly
rejected) or from an oracle that drafts the plain output (accepted whole, so stops fall inside accepted blocks).
"""

import functools

import pytest
import torch
from transformers import pipeline
from transformers.generation.streamers import BaseStreamer

import hf_bpd
from hf_bpd import BlockwiseGenerateOutput, BlockwiseParallelForCausalLM, BPDConfigError, Rescorer
from hf_bpd.lattice import Draft
from tests.conftest import tiny_smollm2_vocab_base

SHAPES = {"chain": {}, "pbest": {"num_drafts": 3, "draft_top_k": 2}, "tree": {"tree": (2, 2, 1)}}


@functools.lru_cache(maxsize=None)
def tiny():
    tokenizer = hf_bpd.load_tokenizer("smollm2-135m-instruct")
    model = BlockwiseParallelForCausalLM.from_base(tiny_smollm2_vocab_base(tokenizer), num_heads=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval(), tokenizer


class Oracle(Rescorer):
    """Drafts the continuation of `reference` (and, for trees, a wrong sibling first)."""

    def __init__(self, reference: list[int]):
        self.reference = reference

    def rescore(self, lattice, context, num_drafts):
        n = lattice.num_heads
        truth = list(self.reference[len(context): len(context) + n]) or [5]
        truth += [5] * (n - len(truth))
        wrong = tuple((t + 1) % 1000 for t in truth)
        return ([Draft(wrong, 0.0)] if num_drafts > 1 else []) + [Draft(tuple(truth), 0.0)]


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def prompt(tokenizer):
    return tokenizer("The quick brown fox jumps over", return_tensors="pt")


def features(tokenizer, reference_text: str, reference_ids: list[int], prompt_length: int) -> dict:
    """generate() keyword sets, each tied to the random base's own plain output so that it acts mid-generation."""
    new = reference_ids[prompt_length:]
    stop = reference_text[len(reference_text) // 2:][:3]  # a string the plain output reaches halfway
    return {
        "stop_strings": dict(stop_strings=[stop], tokenizer=tokenizer),
        "eos_list": dict(eos_token_id=[new[12], new[7]]),
        "min_new_tokens": dict(eos_token_id=new[2], min_new_tokens=10),
        "bad_words_ids": dict(bad_words_ids=[[new[4]], [new[9]]]),
        "sampling_processors": dict(do_sample=True, top_k=1, temperature=0.7, top_p=0.9),
        "repetition": dict(repetition_penalty=1.5, no_repeat_ngram_size=2),
    }


@pytest.mark.parametrize("feature", ["stop_strings", "eos_list", "min_new_tokens", "bad_words_ids",
                                     "sampling_processors", "repetition"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("drafts", ["heads", "oracle"])
def test_feature_matches_plain_decoding(feature, shape, drafts, one_thread):
    model, tokenizer = tiny()
    inputs = prompt(tokenizer)
    free = model.generate(**inputs, max_new_tokens=24, do_sample=False, use_heads=False)
    reference_text = tokenizer.decode(free[0, inputs["input_ids"].shape[1]:])
    kwargs = dict(max_new_tokens=24, **features(tokenizer, reference_text, free[0].tolist(),
                                                inputs["input_ids"].shape[1])[feature])
    kwargs.setdefault("do_sample", False)
    expected = model.generate(**inputs, **kwargs, use_heads=False, return_dict_in_generate=True,
                              output_scores=True)
    rescorer = Oracle(expected.sequences[0].tolist()) if drafts == "oracle" else None
    got = model.generate(**inputs, **kwargs, **SHAPES[shape], rescorer=rescorer, return_dict_in_generate=True,
                         output_scores=True)
    assert got.sequences.tolist() == expected.sequences.tolist(), feature
    assert len(got.scores) == len(expected.scores)
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    stats = got.generation_stats
    assert isinstance(stats, hf_bpd.GenerationStats) and stats is model.last_generation_stats
    assert stats.new_tokens == got.sequences.shape[1] - inputs["input_ids"].shape[1]
    if drafts == "oracle" and shape != "tree" and stats.new_tokens > 4:  # a tree drafts by ranks, not rescorers
        assert stats.block_efficiency > 1.5  # the stop really fell inside accepted blocks


def test_stop_strings_need_the_tokenizer_with_and_without_drafting(one_thread):
    model, tokenizer = tiny()
    inputs = prompt(tokenizer)
    plain = model.generate(**inputs, max_new_tokens=12, stop_strings=["\n"], tokenizer=tokenizer, use_heads=False)
    drafted = model.generate(**inputs, max_new_tokens=12, stop_strings=["\n"], tokenizer=tokenizer)
    assert torch.equal(plain, drafted)
    with pytest.raises(BPDConfigError, match="pass tokenizer=... to generate"):
        model.generate(**inputs, max_new_tokens=12, stop_strings=["\n"])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_streamer_gets_exactly_the_output(shape, one_thread):
    model, tokenizer = tiny()
    inputs = prompt(tokenizer)
    plain_stream, drafted_stream = Collect(), Collect()
    plain = model.generate(**inputs, max_new_tokens=20, streamer=plain_stream, use_heads=False)
    reference = Oracle(plain[0].tolist())
    drafted = model.generate(**inputs, max_new_tokens=20, streamer=drafted_stream, rescorer=reference,
                             **SHAPES[shape])
    assert torch.equal(plain, drafted)
    for stream in (plain_stream, drafted_stream):
        assert stream.ended and stream.chunks[0] == inputs["input_ids"][0].tolist()
        assert sum(stream.chunks[1:], []) == plain[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(drafted_stream.chunks) < len(plain_stream.chunks)  # blocks arrive together


def test_text_generation_pipeline(one_thread):
    model, tokenizer = tiny()
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
    plain = generate("Once upon a time", max_new_tokens=16, do_sample=False, use_heads=False)
    drafted = generate("Once upon a time", max_new_tokens=16, do_sample=False, num_drafts=2, draft_top_k=2)
    assert drafted[0]["generated_text"] == plain[0]["generated_text"]
    assert model.last_generation_stats.method == "p-best"


def test_plain_output_object_carries_statistics_too(one_thread):
    model, tokenizer = tiny()
    out = model.generate(**prompt(tokenizer), max_new_tokens=5, use_heads=False, return_dict_in_generate=True)
    assert isinstance(out, BlockwiseGenerateOutput) and out.generation_stats.method == "plain"
    assert out.generation_stats.block_efficiency == 1.0


def test_unsupported_outputs_are_clear_errors(one_thread):
    model, tokenizer = tiny()
    with pytest.raises(BPDConfigError, match="output_attentions / output_hidden_states"):
        model.generate(**prompt(tokenizer), max_new_tokens=4, return_dict_in_generate=True, output_attentions=True)
    out = model.generate(**prompt(tokenizer), max_new_tokens=4, return_dict_in_generate=True,
                         output_hidden_states=True, use_heads=False)
    assert out.hidden_states is not None


# ------------------------------------------------------------------ drafting options are generation options
def test_generation_config_holds_drafting_options(tmp_path, one_thread):
    model, tokenizer = tiny()
    inputs = prompt(tokenizer)
    expected = model.generate(**inputs, max_new_tokens=12, use_heads=False)
    saved = (model.generation_config.num_drafts, model.generation_config.tree)
    try:
        model.generation_config.num_drafts = 3
        model.generation_config.tree = "2,2"
        assert torch.equal(model.generate(**inputs, max_new_tokens=12), expected)
        assert model.last_generation_stats.method == "tree"
        # a per-call value wins over the config
        model.generate(**inputs, max_new_tokens=4, tree=None)
        assert model.last_generation_stats.method == "p-best"
        model.save_pretrained(tmp_path)
    finally:
        model.generation_config.num_drafts, model.generation_config.tree = saved
    import json

    data = json.loads((tmp_path / "generation_config.json").read_text())
    assert data["num_drafts"] == 3 and data["tree"] == "2,2"
    loaded = BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=model.base_lm)
    assert isinstance(loaded.generation_config, hf_bpd.BlockwiseGenerationConfig)
    assert loaded.generation_config.num_drafts == 3 and loaded.generation_config.tree == "2,2"
    assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id
    assert torch.equal(loaded.generate(**inputs, max_new_tokens=12), expected)
    assert loaded.last_generation_stats.method == "tree"


# ------------------------------------------------------------------ the rescorer registry
def test_a_rescorer_registered_outside_the_package_is_usable_by_name(one_thread):
    @hf_bpd.register_rescorer("last-path-test")
    class LastPath(Rescorer):
        """The heads' p-th best path first: a different, still exact, choice of drafts."""

        calls = 0

        def rescore(self, lattice, context, num_drafts):
            LastPath.calls += 1
            return list(reversed(lattice.best_paths(num_drafts)))

    assert "last-path-test" in hf_bpd.available_rescorers()
    model, tokenizer = tiny()
    inputs = prompt(tokenizer)
    expected = model.generate(**inputs, max_new_tokens=10, use_heads=False)
    got = model.generate(**inputs, max_new_tokens=10, rescorer="last-path-test", num_drafts=2, draft_top_k=2)
    assert torch.equal(got, expected) and LastPath.calls > 0
    with pytest.raises(BPDConfigError, match="already registered"):
        hf_bpd.register_rescorer("ngram")(LastPath)


def test_built_in_rescorers_need_their_files(one_thread):
    model, tokenizer = tiny()
    for name in ("ngram", "neural"):
        with pytest.raises(BPDConfigError, match=f"bundles no {name} rescorer: bundle one"):
            model.generate(**prompt(tokenizer), max_new_tokens=4, rescorer=name)
