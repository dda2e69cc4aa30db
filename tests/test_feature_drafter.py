"""The feature-level drafter (`hf_bpd.feature_drafter`) and its training (`hf_bpd.training.train_drafter`): drafting
step by step on its KV cache equals the whole-sequence pass, and training on extracted features teaches it the base's
next tokens."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

import hf_bpd
from hf_bpd.feature_drafter import FeatureDrafter
from hf_bpd.training import features, train_drafter
from tests.conftest import tiny_base


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drafting_step_by_step_on_the_cache_equals_one_pass(arch):
    base = tiny_base(arch)
    drafter = FeatureDrafter(base, draft_vocab=torch.arange(10, 60)).eval()
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 9, 32, generator=g)
    tokens = torch.randint(3, 96, (1, 9), generator=g)
    positions = torch.arange(9)[None]
    with torch.no_grad():
        whole = drafter(feats, tokens, positions)
        cache = DynamicCache(config=drafter.config)
        pieces = [drafter(feats[:, :4], tokens[:, :4], positions[:, :4], cache)]  # a context, then one at a time
        for i in range(4, 9):
            pieces.append(drafter(feats[:, i:i + 1], tokens[:, i:i + 1], positions[:, i:i + 1], cache))
    assert torch.allclose(torch.cat(pieces, 1), whole, atol=1e-5)
    logits = drafter.logits(whole)
    assert logits.shape == (1, 9, 50)
    assert set(drafter.state_dict()) >= {"fuse.weight", "draft_vocab"}
    assert not any(k.startswith("_frozen") or "embed" in k for k in drafter.state_dict())  # the base's parts


def test_training_on_features_teaches_the_bases_next_tokens(tiny_chat_base, tmp_path):
    torch.manual_seed(0)
    tokenizer = hf_bpd.load_tokenizer(str(tiny_chat_base))
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    with torch.no_grad():  # a random base's next-token distribution is nearly flat: sharpen it (a clear top-1)
        base.model.norm.weight.mul_(30)
    for p in base.parameters():
        p.requires_grad_(False)
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(60):
            f.write(json.dumps({"instruction": f"Count from {i % 7}.", "output": " ".join(
                str(i % 7 + j) for j in range(30))}) + "\n")
    folder = tmp_path / "features"
    features.extract_features(base, tokenizer, [str(chats)], folder, 6000, top_k=4, max_length=96,
                              shard_sequences=20)
    shards = [load_file(f) for f in sorted(folder.glob("shard-*.safetensors"))]
    vocab = torch.unique(torch.cat([t[k].flatten().long() for t in shards for k in ("input_ids", "top_ids")]))
    drafter = FeatureDrafter(base, draft_vocab=vocab)  # a draft vocabulary: the tokens the data uses
    shards_train, shards_eval = train_drafter.shard_files(folder, 1)
    targets = train_drafter.DraftTargets(vocab, base.config.vocab_size)
    before = train_drafter.evaluate(drafter, folder, shards_eval, targets, depths=2)
    result = train_drafter.train(drafter, folder, max_tokens=3500, depths=2, batch_size=4, lr=1e-2, log_every=5)
    after = result["held_out"]
    assert after["loss"] < before["loss"]
    assert after["agreement"][0] > before["agreement"][0] and after["agreement"][0] > 0.3
    assert len(after["agreement"]) == 2 and result["history"]
    train_drafter.save_drafter(drafter, tmp_path / "out", result)
    saved = (tmp_path / "out" / "drafter.safetensors")
    assert saved.exists() and json.loads((tmp_path / "out" / "training.json").read_text())["tokens"] >= 3500
