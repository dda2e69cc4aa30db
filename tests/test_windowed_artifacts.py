"""Artifacts of bases with sliding-window layers (`hf_bpd.runtime.artifacts`, Gemma-3's layout): the step takes the
sliding layers' mask as an input of its own, so one build serves lone sequences and batches, whose rows hold other
positions in a slot than its index. One AOTInductor build of a tiny Gemma-3 (window 8), shared by the module."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.runtime import artifacts, background, batched
from tests.conftest import TINY_CONFIGS
from tests.test_artifacts import eager_step, ragged_batch, step_equals_eager
from tests.test_batch import PAD, check_rows, left_padded, random_prompts
from tests.test_batch_compiled import reference_drafts

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.artifacts]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`(base, package path)`: a tiny Gemma-3's artifact, built with 1 thread into a fresh $HF_BPD_CACHE."""
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_BPD_CACHE", str(tmp_path_factory.mktemp("hf_bpd_cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TINY_CONFIGS["gemma3"]()
    config.layer_types = ["sliding_attention", "full_attention"]  # both layer types (the default pattern: 5 to 1)
    base = AutoModelForCausalLM.from_config(config).eval()
    yield base, artifacts.build(base)
    torch.set_num_threads(threads)
    patch.undo()


def test_the_key_and_the_graphs_of_a_windowed_artifact(built):
    """The key marks the step's second mask input (an artifact built before it had one is not loaded), and no
    one-token batch step is made for it (batches' one-token steps run on the step)."""
    base, path = built
    key = artifacts.cached_key(base)
    assert key["windowed"] == artifacts.WINDOWED_FORMAT
    assert artifacts.valid(path.parent, key) and not artifacts.valid(path.parent, {**key, "windowed": 0})
    assert "window" in artifacts.one_token_unsupported_reason(base)
    loaded = artifacts.load(base)
    assert loaded.window == 8 and artifacts.load(base, threads=2) is None  # built for 1 thread only
    from hf_bpd.evaluation.batch_bench import build_batch_artifacts

    build_batch_artifacts(base)  # what `hf-bpd bench --batch-size` builds first: the step only (its batches never load more)
    assert not any(path.parent.glob("one_token*"))


def test_batch_rows_on_their_own_positions_get_the_eager_step_s_windows(built):
    """A batch's rows whose slots hold other positions than their index (left padding) pass both masks and get what
    the eager step computes from them; a lone sequence's full mask alone (its sliding mask derived outside the graph)
    gives what the eager step gives, deriving it inside."""
    base, path = built
    artifact = artifacts.load(base)
    block, past = 2, 20
    kv, full, ids = ragged_batch(3, block, past)  # row 1: 5 slots of padding, so slot i holds position i - 5
    sliding = full.clone()
    sliding[..., : past - 6] = torch.finfo(torch.float32).min  # the older slots out of the window (both steps' masks)
    positions = torch.stack([past + torch.arange(block), past - 5 + torch.arange(block), past + torch.arange(block)])
    masks = {"full_attention": full, "sliding_attention": sliding}
    _, eager, eager_kv = step_equals_eager(artifact, base, ids, positions, masks, past, kv)
    # the same rows with the sliding mask left open differ: the graph reads the mask it is given
    wide, _ = artifact(ids, positions, {"full_attention": full, "sliding_attention": full}, torch.tensor(past),
                       [t.clone() for t in eager_kv])
    assert not torch.allclose(wide, eager, atol=1e-4)
    # a lone sequence (slot i holds position i, past the window of 8): its full mask alone
    lone_kv = [t[:1].clone() for t in eager_kv]
    lone, _ = artifact(ids[:1], positions[:1], full[:1], torch.tensor(past), lone_kv)
    eager_lone, _ = eager_step(base, ids[:1], positions[:1], full[:1], past, [t[:1].clone() for t in eager_kv])
    assert torch.allclose(lone, eager_lone, atol=1e-4) and not torch.allclose(lone, wide[:1], atol=1e-4)


def test_lone_and_batched_calls_on_the_windowed_artifact_are_exact(built, monkeypatch):
    """`generate(compile=True)`: a lone prompt past the window equals the base's eager greedy output; a batch of
    prompts of 1 to 24 tokens (contexts past the window of 8) with forced drafts that rows accept to different depths
    verifies on the artifact, every row its lone greedy output, and no one-token batch step is asked for."""
    base, _ = built
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3).eval()
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    prompt = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(5))
    out = model.generate(prompt, compile=True, **kwargs)
    assert torch.equal(out, base.generate(prompt, **kwargs))
    assert model.last_generation_stats.verifier == "artifact"

    prompts = random_prompts(5, seed=12, longest=24)
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    reference_drafts(monkeypatch, model, prompts, width, kwargs)
    asked, original = [], background.ready_artifact
    monkeypatch.setattr(background, "ready_artifact", lambda b, graph=artifacts.STEP: asked.append(graph)
                        or original(b, graph))
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert check_rows(model, prompts, out, width, kwargs) == 0
    stats = model.last_generation_stats
    assert stats.verifier == "artifact" and stats.compile_seconds == 0.0
    per_step = list(zip(*[row.accepted_lengths[2:] for row in stats.rows]))
    assert any(len(set(step)) > 2 for step in per_step)  # rows accepted different lengths together
    assert asked and set(asked) == {artifacts.STEP}
    assert all(isinstance(r, batched.ArtifactBatchedRunner) and r.one_token is None
               for r in batched._RUNNERS[base].values())
    out = model.generate(ids, attention_mask=mask, compile=True, use_heads=False, **kwargs)
    assert check_rows(model, prompts, out, width, kwargs) == 0
    assert model.last_generation_stats.verifier == "artifact"
