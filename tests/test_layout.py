"""The package's shape: public transformers API only, thin training scripts, old checkpoints still load."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM
from tests.conftest import VOCAB, tiny_base

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "smollm2-135m-instruct-bpd"


def test_no_private_transformers_api_no_path_hacks():
    pattern = re.compile(r"_assisted_decoding|_bpd_candidate_generator|sys\.path|_get_candidate_generator")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for folder in ("hf_bpd", "training", "benchmarks")
                 for path in (ROOT / folder).rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_scripts_do_not_shadow_installed_modules():
    """`python benchmarks/x.py` puts `benchmarks/` first on `sys.path`: a script named like an installed module or a
    standard one (transformers imports the `kernels` package from PyPI) would be imported in its place."""
    import pkgutil

    paths = [p for p in sys.path if p and Path(p).resolve() != ROOT and ROOT not in Path(p).resolve().parents]
    taken = {m.name for m in pkgutil.iter_modules(paths)} | set(sys.stdlib_module_names)
    scripts = [path for folder in ("benchmarks", "training") for path in (ROOT / folder).glob("*.py")]
    assert scripts and [str(s.relative_to(ROOT)) for s in scripts if s.stem in taken] == []


def test_training_scripts_are_thin_wrappers():
    for script in (ROOT / "training").glob("*.py"):
        if script.name != "__init__.py":
            text = script.read_text()
            assert "from hf_bpd." in text and len(text.splitlines()) <= 20, script.name


def test_train_command_runs_without_the_repository(tmp_path):
    """`hf-bpd train` imports its trainer from the installed package, so it works outside a clone."""
    done = subprocess.run([sys.executable, "-m", "hf_bpd.cli", "train", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--data" in done.stdout


def test_shipped_checkpoint_config_is_human_sized():
    assert (SHIPPED / "config.json").stat().st_size < 8 * 1024
    assert "draft_vocab" in load_file(SHIPPED / "heads.safetensors")
    generation = json.loads((SHIPPED / "generation_config.json").read_text())
    assert generation["rescorer"] == "ngram"


def test_checkpoints_from_before_the_draft_vocabulary_moved_still_load(tmp_path):
    """Old layout: the draft vocabulary and decoding defaults in config.json, no drafting fields elsewhere."""
    vocab = list(range(0, VOCAB, 3))
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=2, draft_vocab=vocab)
    with torch.no_grad():
        for p in model.heads.parameters():
            if p.is_floating_point():
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(draft_vocab=vocab, num_drafts=2, draft_top_k=3, rescorer=None, rescorer_alpha=None)
    del config["draft_vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(tmp_path / "heads.safetensors")
    del state["draft_vocab"]
    save_file(state, tmp_path / "heads.safetensors")
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    for name in ("use_heads", "rescorer", "draft_top_k", "num_drafts", "num_heads_to_use", "tree"):
        generation.pop(name)
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))

    old = BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=model.base_lm)
    assert old.heads.draft_vocab.tolist() == vocab and old.config.draft_vocab_size == len(vocab)
    assert old.generation_config.num_drafts == 2 and old.generation_config.draft_top_k == 3
    ids = torch.tensor([[5, 9, 11, 4]])
    expected = model.base_lm.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(old.generate(ids, max_new_tokens=12, do_sample=False), expected)
    assert old.last_generation_stats.method == "p-best"
    # saved again, it is in the new layout
    old.save_pretrained(tmp_path / "new")
    assert "draft_vocab" not in json.loads((tmp_path / "new" / "config.json").read_text())
    assert load_file(tmp_path / "new" / "heads.safetensors")["draft_vocab"].tolist() == vocab
    again = BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "new", base_model=model.base_lm)
    assert torch.equal(again.generate(ids, max_new_tokens=12, do_sample=False), expected)


def test_public_names():
    assert {"ngram", "neural"} <= set(hf_bpd.available_rescorers())
    for name in ("BlockwiseGenerationConfig", "register_rescorer", "BlockwiseGenerateOutput", "GenerationStats"):
        assert hasattr(hf_bpd, name)


def test_pyproject_lists_every_package_and_leaves_torch_to_the_user():
    """Packages are listed by hand in pyproject.toml (model_cards/ maps to hf_bpd.model_cards): a new subpackage that
    is not listed would be missing from a wheel. torch is a range there; only install.sh pins the CPU wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from setuptools import find_packages

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    assert listed == set(find_packages(str(ROOT), include=["hf_bpd", "hf_bpd.*"])) | {"hf_bpd.model_cards"}
    torch_req = [d for d in project["project"]["dependencies"] if re.match(r"torch\b", d)]
    assert torch_req and "==" not in torch_req[0] and ">=" in torch_req[0]
    assert "torch==2.13.0" in (ROOT / "install.sh").read_text()
    shim = (ROOT / "setup.py").read_text()  # the layout asks for one; it only defers to pyproject.toml
    assert "setup()" in shim and "packages" not in shim


def test_shipped_checkpoints_carry_the_current_remote_code():
    """The code a shipped checkpoint carries for trust_remote_code loading is what save_pretrained writes today (a
    change to hf_bpd/heads.py or the templates must be re-saved into checkpoints/)."""
    from hf_bpd.hub.remote_code import AUTO_MAP, remote_files

    for checkpoint in sorted((ROOT / "checkpoints").iterdir()):
        for name, text in remote_files().items():
            assert (checkpoint / name).read_text() == text, f"{checkpoint.name}/{name} is stale: re-save it"
        config = json.loads((checkpoint / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP and "/" in config["base_model_hub_id"]
