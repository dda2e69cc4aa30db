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


def test_a_fused_drafter_starts_as_the_plain_one_and_learns_its_lift(tmp_path):
    """`feature_layers` (EAGLE-3's fused features): the lift starts as the identity on the final feature, reads the
    same from a forward's hidden-state tuple and from feature batches' `hidden_<i>`, trains, and saves and loads."""
    from hf_bpd.evaluation import drafter_quality

    from tests.conftest import TINY_CONFIGS

    config = TINY_CONFIGS["llama"]()
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    fused = FeatureDrafter(base, draft_vocab=torch.arange(10, 60), feature_layers=[1, 0])
    plain = FeatureDrafter(base, draft_vocab=torch.arange(10, 60))
    plain.load_state_dict({k: v for k, v in fused.state_dict().items() if k not in ("lift.weight", "feature_layers")})
    assert fused.layers_read() == [-1, 1, 0] and plain.layers_read() == [-1]
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        states = base(input_ids=ids, output_hidden_states=True).hidden_states
    by_name = drafter_quality.base_features(base, ids[0], fused.layers_read())
    assert sorted(by_name) == ["hidden_-1", "hidden_0", "hidden_1"]
    assert torch.equal(fused.read_features(states)[0], fused.read_features(by_name))
    assert torch.equal(fused.read_features(states), plain.read_features(states))  # the identity on f at the start
    positions = torch.arange(11)[None]
    with torch.no_grad():
        assert torch.equal(fused(fused.read_features(states)[:, :11], ids[:, 1:], positions),
                           plain(plain.read_features(states)[:, :11], ids[:, 1:], positions))

    batch = {"input_ids": ids.int(), "lengths": torch.tensor([12], dtype=torch.int32),
             **{k: v[None] for k, v in by_name.items()}}
    logits = base(input_ids=ids).logits.float()
    top = logits.topk(4, -1)
    batch["top_ids"], batch["top_logprobs"] = top.indices.int(), top.values - logits.logsumexp(-1, keepdim=True)
    targets = train_drafter.DraftTargets(fused.draft_vocab, base.config.vocab_size)
    loss, counts = train_drafter.drafter_loss(fused, batch, targets, depths=3)
    loss.backward()
    grad = fused.lift.weight.grad
    assert len(counts) == 3 and grad is not None and grad[:, 32:].abs().sum() > 0  # the lower layers get a say

    with torch.no_grad():
        fused.lift.weight.add_(0.01 * torch.randn_like(fused.lift.weight))
    fused.save(tmp_path / "fused", dtype=None)
    again = FeatureDrafter.load(tmp_path / "fused", base)
    assert again.layers_read() == [-1, 1, 0] and torch.equal(again.lift.weight, fused.lift.weight)
    assert torch.equal(again.read_features(states), fused.read_features(states))
    with pytest.raises(ValueError, match="distinct decoder layers 0..1"):
        FeatureDrafter(base, feature_layers=[2])
    with pytest.raises(ValueError, match="distinct decoder layers"):
        FeatureDrafter(base, feature_layers=[0, 0])

    model = hf_bpd.BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    model.load_feature_drafter(tmp_path / "fused")
    with pytest.raises(hf_bpd.BPDConfigError, match=r"fuses base layers \[1, 0\].*--feature-layers none"):
        model.generate(ids[:, :5], max_new_tokens=4, drafter="feature")


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
    with pytest.raises(ValueError, match=r"layers \[-1\], not \[0\]: extract with --layers -1 0"):
        train_drafter.shard_files(folder, 1, layers=[-1, 0])  # a fused drafter needs layer 0's states
    targets = train_drafter.DraftTargets(vocab, base.config.vocab_size)
    held_out = list(train_drafter.batches(folder, shards_eval, 200_000, 8))
    before = train_drafter.evaluate(drafter, lambda m, b: train_drafter.drafter_loss(m, b, targets, 2), held_out)
    result = train_drafter.train(drafter, folder, max_tokens=3500, depths=2, batch_size=4, lr=1e-2, log_every=5)
    after = result["held_out"]
    assert after["loss"] < before["loss"]
    assert after["agreement"][0] > before["agreement"][0] and after["agreement"][0] > 0.3
    assert len(after["agreement"]) == 2 and result["history"]
    train_drafter.save_drafter(drafter, tmp_path / "out", result)
    saved = (tmp_path / "out" / "drafter.safetensors")
    assert saved.exists() and json.loads((tmp_path / "out" / "training.json").read_text())["tokens"] >= 3500


def test_timing_free_chain_acceptance_matches_drafting_from_scratch():
    """`drafter_quality.chain_accepted_lengths` (one teacher-forced pass, its cache cut per step) equals drafting
    each step from scratch along the base's greedy continuation."""
    from hf_bpd.evaluation import drafter_quality

    base = tiny_base("llama")
    with torch.no_grad():
        base.model.norm.weight.mul_(30)
    drafter = FeatureDrafter(base).eval()
    with torch.no_grad():  # a drafter that agrees where the base repeats itself: it predicts the token it reads
        drafter.fuse.weight.zero_()
        drafter.fuse.weight[:, :32] = torch.eye(32)
        for p in drafter.layer.parameters():
            p.zero_()
        drafter.norm.weight.copy_(base.model.norm.weight)  # the embedding, normed as the base's feature is
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    ids = base.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=None)[0]
    features = drafter_quality.base_features(base, ids)
    got = drafter_quality.chain_accepted_lengths(drafter, features, ids, 5, depth=3)

    expected, last = [], 6
    with torch.no_grad():
        while last < len(ids):
            p, room = last - 2, min(3, len(ids) - last)
            cache = DynamicCache(config=drafter.config)
            state = drafter(features[None, :p + 1], ids[None, 1:p + 2], torch.arange(p + 1)[None], cache)[:, -1:]
            count = 0
            for d in range(room):
                token = drafter.logits(state)[0, -1].argmax(-1)
                if int(token) != int(ids[last + d]):
                    break
                count += 1
                state = drafter(state, token.view(1, 1), torch.tensor([[p + 1 + d]]), cache)
            expected.append(count)
            last += count + 1
    assert got == expected and sum(got) > 0
    new = len(ids) - 5
    assert drafter_quality.block_efficiency([(new, got)]) == new / (len(got) + 1)


def test_the_scripts_extract_train_and_measure(tiny_chat_base, tmp_path):
    """Smoke run of `training/extract_features.py`, `training/train_drafter.py` and `benchmarks/draft_quality.py
    --drafters` on a tiny base (its heads checkpoint saved first)."""
    import subprocess
    import sys
    from pathlib import Path

    from hf_bpd import BlockwiseParallelForCausalLM

    root = Path(__file__).resolve().parents[1]
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    checkpoint = tmp_path / "ckpt"
    BlockwiseParallelForCausalLM.from_base(base, num_heads=2).save_pretrained(checkpoint)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i} " * 40}) + "\n"
                             for i in range(24)))
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [f"Say {i}."]}) + "\n" for i in range(2)))
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=root, capture_output=True, text=True, timeout=600)
    done = run("training/extract_features.py", "--base", str(tiny_chat_base), "--output", str(tmp_path / "f"),
               "--max-tokens", "2000", "--sources", str(chats), "--exclude", "--dtype", "fp32",
               "--shard-sequences", "8", "--threads", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens in" in done.stdout
    done = run("training/train_drafter.py", "--features", str(tmp_path / "f"), "--checkpoint", str(checkpoint),
               "--max-tokens", "600", "--batch-size", "4", "--threads", "1", "--output", str(tmp_path / "d"))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "d" / "training.json").read_text())
    assert record["tokens"] >= 600 and len(record["held_out"]["heads_agreement"]) == 2
    assert record["command"].startswith("python training/train_drafter.py --features")
    done = run("benchmarks/draft_quality.py", "--checkpoints", str(checkpoint), "--questions", str(questions),
               "--max-new-tokens", "12", "--rescorer-from", "", "--drafters", str(tmp_path / "d"), "--depths", "2,3",
               "--union-budgets", "2", "--tree-top-k", "1,2", "--threads", "1", "--output", str(tmp_path / "dq.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "dq.json").read_text())["results"]
    rows = [r for r in results if "drafter" in r]
    assert [r["depth"] for r in rows] == [2, 3] and all(1.0 <= r["block_efficiency"] <= 4.0 for r in rows)
    union = {r["drafts"]: r["block_efficiency"] for r in results if "drafts" in r}
    assert len(union) == 1 + 2 * 2 * 2 and all(1.0 <= v <= 4.0 for v in union.values())
    for name, value in union.items():  # verified together: at least what each verifies alone
        if name.startswith("default block, 2 nodes + "):
            assert value >= max(union["default block, 2 nodes"], union[name.removeprefix("default block, 2 nodes + ")])


def test_online_training_side_by_side_with_heads(tiny_chat_base, tmp_path):
    """`training/train_drafter.py --online --tokens` (a stream from `training/tokenize_sources.py`): the base's
    features computed while training, two budgets of a drafter
    and of fresh heads trained side by side on one pass, each saved (bf16) with its held-out agreement and its chain
    block efficiency along greedy references; the saved heads load as a checkpoint and decode exactly."""
    import subprocess
    import sys
    from pathlib import Path

    from hf_bpd import BlockwiseParallelForCausalLM

    root = Path(__file__).resolve().parents[1]
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    checkpoint = tmp_path / "ckpt"
    vocab = list(range(2, 400))
    BlockwiseParallelForCausalLM.from_base(base, num_heads=2, head_type="ffn", head_intermediate_size=48,
                                           draft_vocab=vocab).save_pretrained(checkpoint)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i} " * 40}) + "\n"
                             for i in range(40)))
    tokenizer = hf_bpd.load_tokenizer(str(tiny_chat_base))
    refs = tmp_path / "refs.jsonl"
    with open(refs, "w") as f:
        for i in range(2):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Say {i}."}],
                                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
            out = base.generate(**prompt, max_new_tokens=12, do_sample=False)
            f.write(json.dumps({"id": str(i), "max_new_tokens": 12, "prompt_tokens": prompt["input_ids"].shape[1],
                                "ids": out[0].tolist()}) + "\n")
    tokenized = subprocess.run(
        [sys.executable, "training/tokenize_sources.py", "--base", str(tiny_chat_base), "--sources", f"{chats}*2",
         "--exclude", "--max-tokens", "100000", "--output", str(tmp_path / "stream.safetensors")],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert tokenized.returncode == 0, tokenized.stderr[-2000:]
    assert "tokens in 40 sequences" in tokenized.stdout
    done = subprocess.run(
        [sys.executable, "training/train_drafter.py", "--online", "--tokens", str(tmp_path / "stream.safetensors"),
         "--checkpoint", str(checkpoint), "--max-tokens", "800", "1600", "--heads", "--depths", "2",
         "--feature-layers", "none", "0",
         "--batch-size", "4", "--held-out-sequences", "4", "--dev-references", str(refs), "--dev-depth", "3",
         "--save-dtype", "bf16", "--threads", "1", "--output", str(tmp_path / "curve")],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "curve").iterdir())
    assert names == ["drafter-0.8k", "drafter-1.6k", "drafter-l0-0.8k", "drafter-l0-1.6k", "heads-0.8k",
                     "heads-1.6k"]
    for name in names:
        record = json.loads((tmp_path / "curve" / name / "training.json").read_text())
        assert record["tokens"] >= record["budget"] and len(record["held_out"]["agreement"]) == 2
        assert 1.0 <= record["dev_chain_block_efficiency"] <= 4.0
        assert record["data"].startswith("online, the token stream ") and str(chats) in record["data"]
        assert ("dev_top4_block_efficiency" in record) == name.startswith("drafter")
    state = load_file(tmp_path / "curve" / "drafter-1.6k" / "drafter.safetensors")
    assert state["fuse.weight"].dtype == torch.bfloat16 and state["draft_vocab"].tolist() == vocab
    fused = load_file(tmp_path / "curve" / "drafter-l0-1.6k" / "drafter.safetensors")
    assert fused["feature_layers"].tolist() == [0] and fused["lift.weight"].shape == (32, 64)
    assert "lift.weight" not in state
    assert json.loads(done.stdout)["checkpoint_heads"]["held_out"]["agreement"]
    model = BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "curve" / "heads-1.6k", base_model=base)
    prompt = torch.tensor([[1, 5, 9, 14]])
    want = base.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=None)
    got = model.generate(prompt, max_new_tokens=10, do_sample=False, compile=False, eos_token_id=None,
                         pad_token_id=None)
    assert got.tolist() == want.tolist()


def _repeating_model(tmp_path):
    """A tiny heads model whose base repeats itself (sharpened), with a feature-level drafter that predicts the
    token it reads: many of its drafts are accepted."""
    from hf_bpd import BlockwiseParallelForCausalLM

    base = tiny_base("llama")
    with torch.no_grad():
        base.model.norm.weight.mul_(30)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    drafter = FeatureDrafter(base)
    with torch.no_grad():
        drafter.fuse.weight.zero_()
        drafter.fuse.weight[:, :32] = torch.eye(32)
        for p in drafter.layer.parameters():
            p.zero_()
        drafter.norm.weight.copy_(base.model.norm.weight)
    drafter.save(tmp_path / "drafter", dtype=None)
    model.load_feature_drafter(tmp_path / "drafter")
    return model


def test_acceptance_by_position_walks_as_decoding_does_and_unites_drafters(tmp_path):
    """`tree_accepted_by_position` walked (`walk`) gives the chain's steps; a wider tree accepts at least as much
    at every position; `block_accepted_by_position` walked gives the steps eager `generate()` takes with the same
    heads drafter (every node verified); two drafters verified together accept the longer draft at each position."""
    from hf_bpd.evaluation import drafter_quality as dq
    from hf_bpd.generation.config import drafting_options
    from hf_bpd.generation.decoding import plan_drafting

    model = _repeating_model(tmp_path)
    base, drafter = model.base_lm, model.feature_drafter
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    ids = base.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=None)[0]
    features = dq.base_features(base, ids)
    trees = dq.tree_accepted_by_position(drafter, features, ids, 5, 3, (1, 2))
    for k in (1, 2):
        assert dq.walk(trees[k]) == (len(ids) - 5, dq.chain_accepted_lengths(drafter, features, ids, 5, 3, k))
    assert all(wide >= narrow for narrow, wide in zip(trees[1], trees[2])) and sum(trees[1]) > 0

    options = dict(prompt_lookup=True, draft_nodes=3, draft_schedule="fixed", rescorer=None)
    heads = plan_drafting(model, drafting_options(dict(options), None, model.generation_config)).drafter
    block = dq.block_accepted_by_position(heads, features, ids, 5)
    model.generate(ids[None, :5], max_new_tokens=len(ids) - 5, do_sample=False, eos_token_id=None,
                   pad_token_id=None, compile=False, **options)
    assert dq.walk(block)[1] == model.last_generation_stats.accepted_lengths[1:] and sum(block) > 0
    both = dq.walk([max(a, b) for a, b in zip(block, trees[1])])
    assert dq.block_efficiency([both]) >= max(dq.block_efficiency([dq.walk(t)]) for t in (block, trees[1]))


@pytest.mark.parametrize("options", [{}, {"prompt_lookup": True}, {"draft_depth": 1}, {"draft_depth": 6},
                                     {"compile": True}])
def test_generate_with_the_feature_drafter_equals_greedy_decoding(tmp_path, options):
    model = _repeating_model(tmp_path)
    base = model.base_lm
    for seed in range(3):
        prompt = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
        want = base.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=None)
        got = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=None,
                             drafter="feature", **options)
        assert got.tolist() == want.tolist()
        stats = model.last_generation_stats
        assert stats.method.startswith("feature-chain") and max(stats.accepted_lengths) > 0
        assert max(stats.accepted_lengths) <= options.get("draft_depth", 4)
        assert stats.verifier == ("compiled" if options.get("compile") else "eager")


def test_a_checkpoint_keeps_its_feature_drafter(tmp_path):
    """`save_pretrained` stores the drafter in `feature_drafter/` (bf16), `from_pretrained` loads it, and a
    checkpoint without one says what to do."""
    from hf_bpd import BlockwiseParallelForCausalLM

    model = _repeating_model(tmp_path)
    model.base_lm.save_pretrained(tmp_path / "base")
    model.config.base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "feature_drafter" / "drafter.safetensors")
    assert state["fuse.weight"].dtype == torch.bfloat16
    again = BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert again.feature_drafter is not None
    assert torch.equal(again.feature_drafter.fuse.weight, model.feature_drafter.fuse.weight.bfloat16().float())
    prompt = torch.tensor([[5, 9, 14, 20]])
    want = again.base_lm.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=None)
    assert again.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=None,
                          drafter="feature").tolist() == want.tolist()
    plain = BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=2)
    with pytest.raises(hf_bpd.BPDConfigError, match="needs a feature-level drafter"):
        plain.generate(prompt, max_new_tokens=4, drafter="feature")
    with pytest.raises(hf_bpd.CheckpointError, match="no drafter.safetensors"):
        plain.load_feature_drafter(tmp_path)


@pytest.mark.parametrize("options, message", [
    ({"drafter": "feature", "num_drafts": 2}, "num_drafts would be ignored"),
    ({"drafter": "feature", "rescorer": "ngram"}, "rescorer would be ignored"),
    ({"draft_depth": 3}, "pass drafter='feature'"),
    ({"drafter": "eagle"}, "drafter must be 'heads' or 'feature'"),
    ({"drafter": "feature", "draft_depth": 0}, "draft_depth"),
])
def test_feature_drafting_options_are_checked(tmp_path, options, message):
    model = _repeating_model(tmp_path)
    with pytest.raises((hf_bpd.BPDConfigError, hf_bpd.BPDTypeError), match=message):
        model.generate(torch.tensor([[5, 9, 14]]), max_new_tokens=4, **options)
    with pytest.raises(hf_bpd.BPDConfigError, match="one prompt at a time"):
        model.generate(torch.tensor([[5, 9, 14], [6, 7, 8]]), max_new_tokens=4, drafter="feature")
    with pytest.raises(hf_bpd.BPDConfigError, match="without padding, got 1 padded"):
        model.generate(torch.tensor([[0, 9, 14]]), attention_mask=torch.tensor([[0, 1, 1]]), max_new_tokens=4,
                       drafter="feature")


def test_token_streams_round_trip_and_check_their_vocabulary(tmp_path):
    from hf_bpd.training.token_stream import read_metadata, read_stream, write_stream

    sequences = [[1, 2, 3], [40000, 5], [7] * 10, [9, 9]]
    info = write_stream(iter(sequences), tmp_path / "s.safetensors", max_tokens=14, vocab_size=49152,
                        metadata={"sources": ["a.jsonl"]})
    assert info == {"sources": ["a.jsonl"], "vocab_size": 49152, "sequences": 3, "tokens": 15}  # the last one whole
    assert list(read_stream(tmp_path / "s.safetensors", 49152)) == sequences[:3]
    assert read_metadata(tmp_path / "s.safetensors")["sources"] == ["a.jsonl"]
    assert load_file(tmp_path / "s.safetensors")["tokens"].dtype == torch.uint16
    with pytest.raises(ValueError, match="tokenised for a vocabulary of 49152 ids, the base has 96"):
        next(read_stream(tmp_path / "s.safetensors", 96))
    wide = write_stream(iter([[70000, 1]]), tmp_path / "w.safetensors", 10, vocab_size=100000)
    assert wide["tokens"] == 2 and load_file(tmp_path / "w.safetensors")["tokens"].dtype == torch.int32
    assert list(read_stream(tmp_path / "w.safetensors")) == [[70000, 1]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_stream(iter([[5, 200]]), tmp_path / "bad.safetensors", 10, vocab_size=96)
    with pytest.raises(ValueError, match="gave no sequences"):
        write_stream(iter([]), tmp_path / "none.safetensors", 10, vocab_size=96)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="is not a token stream"):
        read_metadata(tmp_path / "other.safetensors")
