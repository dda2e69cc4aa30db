"""Code-only artifacts of bases too large to hold twice (`artifacts.MAX_FROZEN_WEIGHTS`, here lowered to 0 so a tiny
fp32 base gets one): built without freezing and without the weights, their linear layers oneDNN's, loaded with the
base's own tensors as constants (`hf_bpd.runtime.unfrozen_artifact`). Decoding on them equals the base's eager greedy
`generate()`, and weights changed in place are what they run on."""

import zipfile

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.runtime import artifacts
from hf_bpd.runtime import compiled as verify_runtime
from tests.test_decoding import prompt_ids

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.artifacts]
GREEDY = dict(do_sample=False, eos_token_id=None, max_new_tokens=24)


@pytest.fixture(scope="module")
def unfrozen(tmp_path_factory, one_thread):
    """A tiny fp32 model whose MLP weights (6 MB) outweigh an artifact's code, an empty $HF_BPD_CACHE of its own, and
    every base over 0 bytes treated as too large to freeze into an artifact."""
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_BPD_CACHE", str(tmp_path_factory.mktemp("hf_bpd_cache")))
    patch.setattr(artifacts, "MAX_FROZEN_WEIGHTS", 0)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=8192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    base = AutoModelForCausalLM.from_config(config).eval()
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3).eval()
    with torch.no_grad():  # random heads: drafts get accepted and rejected
        generator = torch.Generator().manual_seed(1)
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    yield model
    verify_runtime.discard_runners(model.base_lm)
    torch._dynamo.reset()
    patch.undo()


def test_the_artifact_holds_no_weights_and_runs_on_the_bases_own(unfrozen):
    base = unfrozen.base_lm
    key = artifacts.cached_key(base)
    assert artifacts.weights_supplied(base) and not artifacts.supplies_constants(base)
    assert key["weights"] == "supplied" and "constants" in key and "ordered" not in key
    assert key["unfrozen"] == artifacts.UNFROZEN_FORMAT
    package = artifacts.build(base)
    record = artifacts.graph_files(package.parent)[1].read_text()
    assert '"weights": "supplied"' in record
    assert package.stat().st_size < artifacts.weight_bytes(base)  # a frozen package would hold all 6 MB
    if torch.backends.mkldnn.is_available():  # its linear layers are oneDNN's, on the unpacked weights
        with zipfile.ZipFile(package) as files:
            wrapper = [files.read(n).decode() for n in files.namelist() if n.endswith(".wrapper.cpp")]
        assert wrapper and "aoti_torch_cpu__linear_pointwise" in wrapper[0]
    artifact = artifacts.load(base, again=True)
    own = artifacts.own_constants(base)
    names = artifact.model.get_constant_fqns()
    assert names and set(names) <= set(own)
    assert all(artifact.constants[name] is own[name] for name in names)  # the base's tensors, not copies


@pytest.mark.parametrize("options", [{"use_heads": False}, {}, {"tree": (2, 2, 1)}], ids=["plain", "chain", "tree"])
def test_decoding_on_the_artifact_equals_eager_generate(unfrozen, options):
    for seed in range(2):
        ids = prompt_ids(seed, 4 + 5 * seed)
        got = unfrozen.generate(ids, compile=True, **options, **GREEDY)
        stats = unfrozen.last_generation_stats
        assert stats.verifier == "artifact" and stats.compile_seconds == 0.0
        assert torch.equal(got, unfrozen.base_lm.generate(ids, **GREEDY))


def outputs_around_a_weight_change(model, ids, **before_options):
    """`generate(compile=True)`'s greedy output on `ids` before and after the base's MLP down projections are scaled
    through `.data` (no version bump); the second runs on the artifact, and differs from the first, so stale weights
    would be caught."""
    before = model.generate(ids, compile=True, **before_options, **GREEDY)
    with torch.no_grad():
        for layer in model.base_lm.model.layers:
            layer.mlp.down_proj.weight.data.mul_(-3.0)
    after = model.generate(ids, compile=True, **GREEDY)
    assert model.last_generation_stats.verifier == "artifact"
    assert not torch.equal(after, before)
    return after


def test_weights_changed_in_place_run_on_the_artifact_with_the_new_weights(unfrozen):
    """The artifact reads the base's own tensors, so its output is the changed base's eager output."""
    ids = prompt_ids(5, 7)
    assert torch.equal(outputs_around_a_weight_change(unfrozen, ids), unfrozen.base_lm.generate(ids, **GREEDY))
