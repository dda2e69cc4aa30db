"""Feature extraction for feature-level drafters (`hf_bpd.training.features`): the base's own hidden states and
next-token distributions, held-out prompts excluded, shards that resume to exactly what one run writes."""

import gzip
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_bpd
from hf_bpd.training import features
from hf_bpd.training.data import held_out_prompts


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("feature-data")
    chats = folder / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(9):
            f.write(json.dumps({"instruction": f"Question number {i}: what is {i} plus {i}?",
                                "output": f"The sum of {i} and {i} is {2 * i}. " * (1 + i % 3)}) + "\n")
    wiki = folder / "enwiki_sample.txt.gz"
    with gzip.open(wiki, "wt") as f:
        for i in range(3):
            f.write(f'<doc id="{i}" title="T{i}">\nT{i}\n' + "A sentence about the topic of this article. " * 40 +
                    "\n</doc>\n")
    held = folder / "held.jsonl"
    held.write_text(json.dumps({"prompt": "Question number 4: what is 4 plus 4?"}) + "\n")
    return [str(chats), str(wiki)], str(held)


def test_features_are_the_bases_own_and_resume_exactly(tiny_chat_base, data, tmp_path):
    sources, held = data
    tokenizer = hf_bpd.load_tokenizer(str(tiny_chat_base))
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    held_out = held_out_prompts([held])
    run = dict(held_out=held_out, layers=(0, -1), top_k=4, max_length=128, batch_size=2, shard_sequences=3)
    whole = features.extract_features(base, tokenizer, sources, tmp_path / "whole", 1500, **run)
    part = features.extract_features(base, tokenizer, sources, tmp_path / "part", 500, **run)
    assert len(part["shards"]) < len(whole["shards"])
    resumed = features.extract_features(base, tokenizer, sources, tmp_path / "part", 1500, **run)
    assert resumed["shards"] == whole["shards"] and sum(s["tokens"] for s in whole["shards"]) >= 1500
    for shard in whole["shards"]:
        a, b = load_file(tmp_path / "whole" / shard["file"]), load_file(tmp_path / "part" / shard["file"])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    seen = set()
    for shard in whole["shards"]:
        tensors = load_file(tmp_path / "whole" / shard["file"])
        for row in range(len(tensors["lengths"])):
            n = int(tensors["lengths"][row])
            ids = tensors["input_ids"][row, :n].long()
            seen.add(tokenizer.decode(ids))
            with torch.no_grad():
                out = base(ids[None], output_hidden_states=True)
            assert torch.allclose(tensors["hidden_-1"][row, :n].float(), out.hidden_states[-1][0], atol=2e-2,
                                  rtol=2e-2)
            assert torch.allclose(tensors["hidden_0"][row, :n].float(), out.hidden_states[1][0], atol=2e-2,
                                  rtol=2e-2)
            assert torch.equal(tensors["top_ids"][row, :n, 0].long(), out.logits[0].argmax(-1))
    text = " ".join(seen)
    assert "Question number 3" in text and "A sentence about the topic" in text
    assert "Question number 4" not in text  # held out


def test_other_settings_do_not_mix_into_a_folder(tiny_chat_base, data, tmp_path):
    sources, _ = data
    tokenizer = hf_bpd.load_tokenizer(str(tiny_chat_base))
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    features.extract_features(base, tokenizer, sources, tmp_path, 100, top_k=4, max_length=64, shard_sequences=2)
    with pytest.raises(ValueError, match="other settings"):
        features.extract_features(base, tokenizer, sources, tmp_path, 200, top_k=8, max_length=64)
