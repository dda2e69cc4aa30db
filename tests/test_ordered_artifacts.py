"""Artifacts of code only for bf16 bases on hf_bpd's kernels (`hf_bpd.runtime.artifacts`): built once per machine
without the weights, loaded with the process's own packed weights as constants; their steps equal the in-process
compiled step's bit for bit (tree blocks included), drafted decoding on them equals plain decoding, and weights
changed in place are what they run on; int8-weight bases get them too."""

import pytest
import torch

from hf_bpd.runtime import artifacts, background
from hf_bpd.runtime import compiled as verify_runtime
from hf_bpd.runtime.compiled import ArtifactRunner
from hf_bpd.runtime.compiled_verifier import CompiledVerifier
from hf_bpd.generation.tree import DraftTree
from tests.test_decoding import prompt_ids
from tests.test_kernels import REASON, _head_dim_16_bpd
from tests.test_ordered_attention import assert_tree_rows_equal_one_token_steps
from tests.test_unfrozen_artifacts import outputs_around_a_weight_change

pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"hf_bpd's kernels: {REASON}"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.artifacts]
GREEDY = dict(do_sample=False, eos_token_id=None, max_new_tokens=24)


@pytest.fixture(scope="module")
def ordered(tmp_path_factory, one_thread):
    """A tiny bf16 model the kernels serve (head dim 16) and an empty $HF_BPD_CACHE of its own."""
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_BPD_CACHE", str(tmp_path_factory.mktemp("hf_bpd_cache")))
    model = _head_dim_16_bpd()
    yield model
    verify_runtime.discard_runners(model.base_lm)
    torch._dynamo.reset()
    patch.undo()


def in_process(model, ids, **options):
    """`generate(compile=True)` with the step compiled in the process (artifacts off)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_BPD_OFF", "artifacts")
        out = model.generate(ids, compile=True, **GREEDY, **options)
        assert model.last_generation_stats.verifier == "compiled"
        return out


def test_without_an_artifact_the_call_compiles_its_step_while_one_is_built(ordered, monkeypatch):
    """No artifact yet: the call compiles in the process (an eager block would not round as compiled plain decoding
    does) and starts the background build of an artifact keyed by the constants' layout, not by their bytes."""
    started = []
    monkeypatch.setattr(background, "start_build", lambda base, key, directory, graph=artifacts.STEP:
                        started.append((key, graph)))
    ids = prompt_ids(0, 6)
    assert torch.equal(ordered.generate(ids, compile=True, **GREEDY), in_process(ordered, ids, use_heads=False))
    assert ordered.last_generation_stats.verifier == "compiled"
    assert len(started) == 1 and started[0][1] == artifacts.STEP
    key = started[0][0]
    assert key["weights"] == "supplied" and key["ordered"] == artifacts.ORDERED_FORMAT and "constants" in key


def test_the_artifact_is_code_only_and_its_steps_equal_the_compiled_step(ordered):
    base = ordered.base_lm
    package = artifacts.build(base)
    weight_bytes = sum(t.numel() * t.element_size() for t in artifacts.supplied_constants(base).values())
    assert package.is_file() and artifacts.load(base, again=True) is not None
    assert len(artifacts.load(base).model.get_constant_fqns()) == len(artifacts.supplied_constants(base))
    record = artifacts.graph_files(package.parent)[1].read_text()
    assert '"weights": "supplied"' in record and weight_bytes > 0
    runner = verify_runtime.compiled_runner(base, 64, artifacts.load(base))
    assert isinstance(runner, ArtifactRunner) and runner.ordered
    assert_tree_rows_equal_one_token_steps(ordered, runner)
    # the same tree block on the artifact and on the step compiled in the process: bit for bit
    compiled = verify_runtime.compiled_runner(base, 64)
    tree, ids = DraftTree([(20, 21), (7, 8, 9), (7, 30)]), prompt_ids(3, 11)
    blocks = []
    for each in (runner, compiled):
        with each.lock, torch.no_grad():
            verifier = CompiledVerifier(ordered, each)
            verifier.buckets = [1, 8]
            verifier.prefill(ids)
            blocks.append(verifier.verify(5, tree, "cpu"))
            verifier.close(10 ** 9)
    assert torch.equal(blocks[0][0], blocks[1][0]) and torch.equal(blocks[0][1], blocks[1][1])


@pytest.mark.parametrize("options", [{}, {"tree": (2, 2, 1)}], ids=["chain", "tree"])
def test_drafted_decoding_on_the_artifact_equals_plain_decoding(ordered, options):
    for seed in range(2):
        ids = prompt_ids(seed, 4 + 5 * seed)
        plain = ordered.generate(ids, compile=True, use_heads=False, **GREEDY)
        assert ordered.last_generation_stats.verifier == "artifact"
        got = ordered.generate(ids, compile=True, **options, **GREEDY)
        stats = ordered.last_generation_stats
        assert stats.verifier == "artifact" and stats.compile_seconds == 0.0
        assert torch.equal(got, plain) and torch.equal(plain, in_process(ordered, ids, use_heads=False))


def test_weights_changed_in_place_run_on_the_artifact_with_the_new_weights(ordered):
    """A write through `.data` (no version bump): the artifact is given the new packed weights, so its output is the
    changed base's compiled plain decoding."""
    ids = prompt_ids(5, 7)
    after = outputs_around_a_weight_change(ordered, ids, use_heads=False)
    assert torch.equal(after, in_process(ordered, ids, use_heads=False))


def test_an_int8_weight_base_gets_a_code_only_artifact_too(ordered):
    """Its artifact takes the int8 packed weights and their scales as constants (another layout, another key) and
    decodes as its step compiled in the process does; a background worker rebuilds the layout from a bf16 copy."""
    from hf_bpd import quantize_int8_weights

    model = _head_dim_16_bpd()
    quantize_int8_weights(model.base_lm)
    base = model.base_lm
    assert artifacts.supplies_constants(base)
    assert artifacts.cached_key(base)["constants"] != artifacts.cached_key(ordered.base_lm)["constants"]
    artifacts.build(base)
    for seed in range(2):
        ids = prompt_ids(seed, 5 + 4 * seed)
        plain = model.generate(ids, compile=True, use_heads=False, **GREEDY)
        got = model.generate(ids, compile=True, tree=(2, 2, 1), **GREEDY)
        assert model.last_generation_stats.verifier == "artifact"
        assert torch.equal(got, plain) and torch.equal(plain, in_process(model, ids, use_heads=False))
    verify_runtime.discard_runners(base)
