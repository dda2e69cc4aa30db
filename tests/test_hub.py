"""push_to_hub, offline: the exact files a push would upload (the Hub client is replaced by a recorder)."""

from pathlib import Path

import pytest
from huggingface_hub import HfApi
from safetensors.torch import load_file

from hf_bpd import BlockwiseParallelForCausalLM, BPDError
from tests.conftest import tiny_base


def test_push_to_hub_uploads_heads_config_and_card(monkeypatch):
    pushed = {}

    def create_repo(self, repo_id, **kwargs):
        pushed["repo"] = repo_id
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        pushed["files"] = sorted(p.name for p in folder.iterdir())
        pushed["keys"] = sorted(load_file(folder / "heads.safetensors"))
        pushed["card"] = (folder / "README.md").read_text()
        pushed["kwargs"] = kwargs
        return "commit-url"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("qwen2"), num_heads=2)
    assert model.push_to_hub("me/tiny-bpd", commit_message="heads") == "commit-url"
    assert pushed["repo"] == "me/tiny-bpd"
    assert pushed["files"] == ["README.md", "config.json", "configuration_bpd.py", "generation_config.json",
                               "heads.safetensors", "heads_bpd.py", "modeling_bpd.py"]
    assert pushed["keys"] and all(k.startswith("heads.") for k in pushed["keys"])
    assert "library_name: transformers" in pushed["card"] and "2 resblock head(s)" in pushed["card"]
    assert pushed["kwargs"]["commit_message"] == "heads"


def test_push_to_hub_without_the_hub_is_a_one_line_error(monkeypatch):
    """A real push to an endpoint where nothing listens: the Hub client's connection error becomes one line."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("qwen2"), num_heads=2)
    with pytest.raises(BPDError, match=r"cannot be reached: connect and retry, or save_pretrained") as err:
        model.push_to_hub("me/tiny-bpd")
    assert "\n" not in str(err.value)
