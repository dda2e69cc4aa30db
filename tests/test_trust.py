"""What a checkpoint from the Hub may make hf_bpd read and run (docs/reliability.md "What a checkpoint can make
hf_bpd read"): downloads fetch only the files config.json names, nothing native parses a bundled file at load, and a
file native code parses is read from a Hub snapshot only when its sha256 is pinned outside that repo."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub.utils import filter_repo_objects

from hf_bpd import BlockwiseParallelForCausalLM, CheckpointError, NeuralRescorer, NgramRescorer
from hf_bpd.hub.bundled import pinned_files
from hf_bpd.hub.checkpoints import checkpoint_files, is_hub_snapshot
from hf_bpd.rescorers import kenlm as bpd_kenlm
from tests.test_bad_input import GREEDY, checkpoint, ids, ngram_path, one_line, tiny  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def as_snapshot(source: Path, root: Path) -> Path:
    """`source` copied where the Hub client keeps a download: `models--<org>--<name>/snapshots/<revision>/`."""
    snapshot = root / "hub" / "models--me--tiny-bpd" / "snapshots" / ("0" * 40)
    shutil.copytree(source, snapshot)
    return snapshot


def garble_consistently(checkpoint_dir: Path) -> Path:
    """Garble the bundled KenLM binary and record the garbled file's sha256 in config.json: a repo that lies
    consistently, so only a pin from outside the repo can refuse it."""
    path = checkpoint_dir / "rescorers" / "lm.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 256] = bytes(range(256))
    path.write_bytes(bytes(data))
    config = json.loads((checkpoint_dir / "config.json").read_text())
    config["rescorers"]["ngram"]["sha256"] = bpd_kenlm.file_sha256(path)
    (checkpoint_dir / "config.json").write_text(json.dumps(config))
    return path


def test_a_hub_snapshot_loads_without_parsing_its_kenlm_file_and_refuses_it_unpinned(checkpoint, tmp_path):
    snapshot = as_snapshot(checkpoint, tmp_path)
    assert is_hub_snapshot(snapshot) and not is_hub_snapshot(checkpoint)
    garble_consistently(snapshot)
    model = BlockwiseParallelForCausalLM.from_pretrained(snapshot)  # parses JSON and safetensors only
    assert "ngram" in model.bundled_rescorers
    with pytest.raises(CheckpointError) as err:
        model.generate(ids(), max_new_tokens=6, rescorer="ngram", **GREEDY)
    one_line(err, "trust_bundled_files=True", "sha256")
    want = model.base_lm.generate(ids(), max_new_tokens=6, **GREEDY)
    assert torch.equal(model.generate(ids(), max_new_tokens=6, rescorer=None, **GREEDY), want)


def test_trust_bundled_files_reads_a_snapshot_on_its_own_hashes(checkpoint, tmp_path):
    snapshot = as_snapshot(checkpoint, tmp_path)
    model = BlockwiseParallelForCausalLM.from_pretrained(snapshot, trust_bundled_files=True)
    want = model.base_lm.generate(ids(), max_new_tokens=8, **GREEDY)
    assert torch.equal(model.generate(ids(), max_new_tokens=8, rescorer="ngram", **GREEDY), want)
    assert isinstance(model.bundled_rescorers["ngram"], NgramRescorer)


def test_a_local_checkpoint_is_checked_against_its_own_hashes_before_kenlm_reads_it(checkpoint):
    path = checkpoint / "rescorers" / "lm.bin"
    data = bytearray(path.read_bytes())
    data[100:140] = b"\xff" * 40
    path.write_bytes(bytes(data))
    model = BlockwiseParallelForCausalLM.from_pretrained(checkpoint)  # loading parses nothing native
    with pytest.raises(bpd_kenlm.NgramError) as err:
        model.generate(ids(), max_new_tokens=4, rescorer="ngram", **GREEDY)
    one_line(err, str(path), "config.json")


def test_a_download_fetches_only_the_files_config_json_names(checkpoint, tmp_path):
    """The patterns go to `snapshot_download(allow_patterns=...)`, which filters with `filter_repo_objects`: the
    files they let through are enough to load and decode, and no pickle or code comes along."""
    for junk in ("pytorch_model.bin", "evil.py", "rescorers/notes.pkl", "rescorers/lm.bin.py"):
        (checkpoint / junk).write_bytes(b"not read")
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    config = json.loads((checkpoint / "config.json").read_text())
    fetched = set(filter_repo_objects(files, allow_patterns=checkpoint_files(config)))
    assert fetched == {"config.json", "generation_config.json", "heads.safetensors", "rescorers/lm.bin"}
    target = tmp_path / "fetched"
    for name in fetched:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(checkpoint / name, target / name)
    model = BlockwiseParallelForCausalLM.from_pretrained(target)
    want = model.base_lm.generate(ids(1), max_new_tokens=8, **GREEDY)
    assert torch.equal(model.generate(ids(1), max_new_tokens=8, rescorer="ngram", **GREEDY), want)


def test_allow_patterns_cover_the_shipped_checkpoints_folders():
    shipped = ROOT / "checkpoints" / "smollm2-135m-instruct-bpd"
    files = sorted(str(p.relative_to(shipped)) for p in shipped.rglob("*") if p.is_file())
    fetched = set(filter_repo_objects(files, allow_patterns=checkpoint_files(json.loads(
        (shipped / "config.json").read_text()))))
    assert {"rescorers/mixed_4gram.bin", "rescorers/neural_rescorer/adapter_model.safetensors",
            "rescorers/neural_rescorer/adapter_config.json", "feature_drafter/drafter.safetensors"} <= fetched
    assert not any(name.endswith(".py") for name in fetched)  # remote code is for transformers, not read here


def test_the_pinned_list_is_the_shipped_checkpoints_native_files():
    shipped = {bpd_kenlm.file_sha256(p) for p in ROOT.glob("checkpoints/*/rescorers/*.bin")}
    assert shipped and pinned_files() == shipped


def test_a_pinned_file_from_the_hub_needs_no_trust(smollm2, tmp_path):
    base, _ = smollm2
    snapshot = as_snapshot(ROOT / "checkpoints" / "smollm2-135m-instruct-bpd", tmp_path)
    model = BlockwiseParallelForCausalLM.from_pretrained(snapshot, base_model=base)
    assert isinstance(model.bundled_rescorers["ngram"], NgramRescorer)  # hf_bpd pins this file's sha256


def test_a_neural_rescorer_without_safetensors_is_refused(tmp_path):
    folder = tmp_path / "neural"
    tiny().base_lm.save_pretrained(folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"a pickle would run code")
    with pytest.raises(CheckpointError) as err:
        NeuralRescorer.from_bundle(tiny().base_lm, folder, type="model")
    one_line(err, "no safetensors")
