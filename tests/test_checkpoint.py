"""The shipped checkpoint `checkpoints/smollm2-135m-instruct-bpd`: loads offline the way the README does, and decodes
token-identically to SmolLM2's own greedy `generate()` with every bundled rescorer and 1, 4 and 16 drafts."""

from pathlib import Path

import pytest
import torch

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.rescorers.neural import NeuralRescorer
from hf_bpd.rescorers.ngram import NgramRescorer

pytestmark = pytest.mark.autotune  # compiled and run as users' are (tests/conftest.py)

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-bpd"
PROMPTS = [  # held-out style instructions (not in the training prompts)
    "Write a Python function that checks whether a number is prime.",
    "A farmer has 12 cows and buys 7 more. Each cow gives 3 litres of milk a day. How much milk does he get a day?",
    "Give three reasons why people enjoy hiking.",
    "Explain what an API is to a beginner.",
]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def shipped(smollm2):
    model = BlockwiseParallelForCausalLM.from_pretrained(CHECKPOINT)  # finds its base through load_base
    tokenizer = hf_bpd.load_tokenizer(str(CHECKPOINT))
    inputs = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True) for p in PROMPTS]
    with torch.no_grad():
        expected = [model.base_lm.generate(**x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False) for x in inputs]
    return model, inputs, expected


def test_shipped_checkpoint_bundles_what_the_readme_uses(shipped):
    model, _, _ = shipped
    assert model.config.num_heads >= 4
    assert model.config.base_model_name_or_path == "smollm2-135m-instruct"
    assert set(model.config.rescorers) == {"ngram", "neural"}
    assert isinstance(model.bundled_rescorers["ngram"], NgramRescorer)
    assert isinstance(model.bundled_rescorers["neural"], NeuralRescorer)
    assert (CHECKPOINT / "README.md").read_text().count("Block efficiency") >= 1


# each rescorer and each draft count at least once (the full 3 x 3 grid added ~3.5 min of eager decoding to the suite)
@pytest.mark.parametrize("rescorer, num_drafts", [(None, 4), ("ngram", 1), ("ngram", 16), ("neural", 16)])
def test_shipped_checkpoint_is_exact_with_each_rescorer(shipped, rescorer, num_drafts):
    model, inputs, expected = shipped
    served = 0
    for x, want in zip(inputs, expected):  # every node verified: what pays is the cost schedule's tests' concern
        got = model.generate(**x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, rescorer=rescorer,
                             num_drafts=num_drafts, compile=False, draft_schedule="fixed")
        assert torch.equal(got, want), (rescorer, num_drafts, x["input_ids"].shape)
        served += sum(model.last_generation_stats.accepted_lengths)
    assert served > 0  # trained heads get drafts accepted: the verifier's accept path is exercised


def test_shipped_checkpoint_tree_with_ngram_is_exact(shipped):
    model, inputs, expected = shipped
    for x, want in zip(inputs[:2], expected[:2]):  # a tree of 15 nodes: its cheapest telling size
        got = model.generate(**x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, rescorer="ngram",
                             tree=hf_bpd.sparse_tree((3, 2, 1)), num_heads_to_use=3, compile=False)
        assert torch.equal(got, want)


@pytest.mark.artifacts  # the step install.sh built for this machine
def test_shipped_checkpoint_default_generate_is_exact(shipped):
    """What a user gets: the checkpoint's generation_config.json (compiled verification, 4 heads, the 8 best n-gram
    paths and prompt lookup's copy competing for the 7 draft nodes of a compiled block of 8, of which the cost
    schedule verifies the likeliest that pay), token for token against SmolLM2's eager greedy generate()."""
    from hf_bpd.runtime.compiled import COMPILED_DRAFT_SLOTS

    model, inputs, expected = shipped
    config = model.generation_config
    assert (config.compile, config.num_heads_to_use, config.rescorer, config.prompt_lookup) == (True, 4, "ngram", True)
    assert (config.num_drafts, config.draft_nodes, config.draft_schedule) == (8, COMPILED_DRAFT_SLOTS, "cost")
    assert model.config.head_calibration["ranks"][0] < 1  # measured: a second-best path's tokens are weighed less
    served = 0
    for x, want in zip(inputs, expected):
        got = model.generate(**x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert torch.equal(got, want), x["input_ids"].shape
        stats = model.last_generation_stats
        assert stats.method == "p-best+lookup/7 nodes" and max(stats.draft_tokens) <= COMPILED_DRAFT_SLOTS
        served += sum(stats.accepted_lengths)
    assert served > 0  # drafts were accepted
    # how many nodes pay depends on this machine's block costs (an AVX2 CPU's block of 8 rarely pays); with every node
    # verified the paths and the copy fill the block
    x, want = inputs[0], expected[0]
    got = model.generate(**x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, draft_schedule="fixed")
    assert torch.equal(got, want)
    assert max(model.last_generation_stats.draft_tokens) == COMPILED_DRAFT_SLOTS


@pytest.mark.artifacts
def test_readme_main_job_prints_text_block_efficiency_and_speedup(shipped, capsys):
    """`hf-bpd generate --model checkpoints/smollm2-135m-instruct-bpd --chat --compare`, shortened, as the README runs
    it (the compiled step install.sh built; every compiled row of the table runs compiled). The eager rows of the
    table are the CLI tests' (tests/test_cli.py), on a tiny model."""
    from hf_bpd.cli import main

    assert main(["generate", "--model", str(CHECKPOINT), "--chat", "--compare", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "block efficiency:" in out and "speed-up:" in out and "identical output: True" in out
    assert "| plain greedy generate() |" in out and "| NO |" not in out
    assert "verification: artifact" in out and "| plain decoding, compiled (use_heads=False, compile=True) |" in out
    assert "| bpd (heads' top-1 draft, compiled) |" in out
    assert "| bpd + ngram + lookup, 8-best, 7 nodes, compiled, cost schedule (above) |" in out


def test_shipped_gemma_checkpoint_is_exact_and_drafts(tmp_path):
    """The second packaged base: gemma-3-270m heads (bf16-stored, loaded in the base's fp32) with their bundled
    4-gram, eagerly (its compiled sliding-window step is tests/test_windowed_artifacts.py's, at its cheapest size);
    a batch of two prompts too (sliding-window layers, batched drafting)."""
    from tests.test_batch import left_padded

    gemma = CHECKPOINT.parent / "gemma-3-270m-bpd"
    model = BlockwiseParallelForCausalLM.from_pretrained(gemma)
    tokenizer = hf_bpd.load_tokenizer(str(gemma))
    assert model.config.base_model_name_or_path == "gemma-3-270m" and set(model.config.rescorers) == {"ngram"}
    assert {p.dtype for p in model.heads.parameters()} == {torch.float32}
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"][0] for p in
               ("Question: A shop sells 3 apples for 2 dollars. How much do 12 apples cost?\nAnswer:",
                "def fibonacci(n):")]
    accepted, wanted = 0, []
    for ids in prompts:
        want = model.base_lm.generate(ids[None], max_new_tokens=32, do_sample=False)
        wanted.append(want[0, len(ids):])
        # the defaults' drafting and p-best paths (the heads' chain on a real base: tests/test_real_models.py)
        for options in ({}, {"num_drafts": 4}):
            assert torch.equal(model.generate(ids[None], max_new_tokens=32, do_sample=False, compile=False,
                                              **options), want)
            assert model.last_generation_stats.verifier == "eager"
            accepted += sum(model.last_generation_stats.accepted_lengths)
    assert accepted > 0
    batch, mask = left_padded(prompts)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=32, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    for r, want in enumerate(wanted):
        assert torch.equal(out[r, batch.shape[1]: batch.shape[1] + len(want)], want)
