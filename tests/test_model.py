"""BlockwiseParallelForCausalLM on tiny random Llama / GPT-2 / Qwen2 / Gemma3 bases."""

import json

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

import hf_bpd
from hf_bpd import BaseModelError, BlockwiseParallelForCausalLM, CheckpointError
from tests.conftest import VOCAB, tiny_base


def batch(seed=0, size=(2, 12)):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, size, generator=generator)


def train_heads(model, steps=30, lr=3e-2, ids=None):
    """A few AdamW steps on the trainable parameters; returns the losses."""
    ids = batch() if ids is None else ids
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        out = model(ids, labels=ids, return_head_logits=False)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("head_type", ["resblock", "ffn"])
def test_wrap_forward_and_fresh_heads_equal_base(arch, head_type):
    base = tiny_base(arch)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3, head_type=head_type, num_layers_per_head=2)
    ids = batch()
    with torch.no_grad():
        out = model(ids)
        ref = base(ids).logits
    assert torch.equal(out.logits, ref)
    assert out.head_logits.shape == (2, 3, 12, VOCAB)
    # Zero-initialised output side: every fresh head predicts exactly the base's next-token distribution.
    for h in range(3):
        torch.testing.assert_close(out.head_logits[:, h], ref, rtol=1e-5, atol=1e-5)


def test_loss_is_the_bpd_objective(arch):
    """loss = sum_h lambda_h CE(head h at t, token t+1+h), checked against a direct computation."""
    model = BlockwiseParallelForCausalLM.from_base(tiny_base(arch), num_heads=3, head_loss_weights=[1.0, 0.5, 2.0])
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(std=0.2)
    ids = batch(1)
    labels = ids.clone()
    labels[0, 5] = -100
    with torch.no_grad():
        out = model(ids, labels=labels)
    expected = []
    for h in range(3):
        shift = h + 2
        logits = out.head_logits[:, h, :-shift]
        targets = labels[:, shift:]
        expected.append(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))
    expected = torch.stack(expected)
    torch.testing.assert_close(out.head_losses, expected)
    torch.testing.assert_close(out.loss, (torch.tensor([1.0, 0.5, 2.0]) * expected).sum())
    base_ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.base_loss, base_ce)


def test_loss_decreases_with_frozen_base(arch):
    base = tiny_base(arch)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    model.freeze_base()
    counts = model.trainable_parameters()
    assert counts["base"] == 0 and counts["heads"] > 0
    before = {k: v.clone() for k, v in base.state_dict().items()}
    losses = train_heads(model)
    assert losses[-1] < 0.7 * losses[0]
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), f"frozen base weight {k} changed"


def test_save_load_round_trip_and_auto(tmp_path, arch, tiny_base_dir):
    model = BlockwiseParallelForCausalLM.from_base(str(tiny_base_dir), num_heads=3, head_type="ffn")
    model.freeze_base()
    train_heads(model, steps=5)
    model.save_pretrained(tmp_path / "bpd")

    files = sorted(p.name for p in (tmp_path / "bpd").iterdir())
    assert files == ["README.md", "config.json", "configuration_bpd.py", "generation_config.json", "heads.safetensors",
                     "heads_bpd.py", "modeling_bpd.py"]  # the .py files: loading without hf_bpd (test_remote_code)
    saved = load_file(tmp_path / "bpd" / "heads.safetensors")
    assert all(k.startswith("heads.") for k in saved), "base weights leaked into the heads checkpoint"
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in model.heads.parameters())
    config = json.loads((tmp_path / "bpd" / "config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_base_dir)
    assert config["base_model_fingerprint"] == hf_bpd.fingerprint(model.base_lm)
    assert "BPD heads" in (tmp_path / "bpd" / "README.md").read_text()

    ids = batch(2)
    with torch.no_grad():
        expected = model(ids).head_logits
        loaded = BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "bpd")
        assert torch.equal(loaded(ids).head_logits, expected)
        auto = AutoModelForCausalLM.from_pretrained(tmp_path / "bpd")
        assert isinstance(auto, BlockwiseParallelForCausalLM)
        assert torch.equal(auto(ids).head_logits, expected)
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "bpd"), hf_bpd.BlockwiseParallelConfig)


def test_lora_on_heads_trains_only_lora(arch):
    model = BlockwiseParallelForCausalLM.from_base(tiny_base(arch), num_heads=2, num_layers_per_head=2)
    peft_model = get_peft_model(model, hf_bpd.bpd_lora_config(model, r=4, lora_alpha=8))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    losses = train_heads(peft_model, steps=25)
    assert losses[-1] < losses[0]
    changed = {n for n, p in peft_model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable, f"non-LoRA parameters changed: {changed - trainable}"
    assert any("lora_B" in n for n in changed)


def test_lora_on_base_and_heads_medusa2(arch):
    """Medusa-2: LoRA in the base trained jointly with the heads, keeping the base's next-token loss."""
    model = BlockwiseParallelForCausalLM.from_base(tiny_base(arch), num_heads=2)
    model.freeze_base()
    base_targets = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"],
                    "gemma3": ["q_proj", "v_proj"]}[arch]
    peft_model = get_peft_model(model, hf_bpd.bpd_lora_config(model, r=4, heads="full", base_target_modules=base_targets))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or ".heads." in n for n in trainable)
    ids = batch()
    out = peft_model(ids, labels=ids, base_loss_weight=1.0, return_head_logits=False)
    out.loss.backward()
    grads = {n for n, p in peft_model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any("base_lm" in n and "lora_" in n for n in grads)
    assert any("heads" in n and "lora_" not in n for n in grads)


def test_draft_vocabulary(arch):
    draft_vocab = list(range(0, VOCAB, 2))  # even ids only
    base = tiny_base(arch)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2, draft_vocab=draft_vocab)
    ids = batch()
    with torch.no_grad():
        out = model(ids, labels=ids)
        ref = base(ids).logits
    assert out.head_logits.shape[-1] == len(draft_vocab)
    # a fresh head equals the base restricted to the draft vocabulary
    torch.testing.assert_close(out.head_logits[:, 0], ref[..., draft_vocab], rtol=1e-5, atol=1e-5)
    best = model.heads.to_vocab_ids(out.head_logits[:, 0].argmax(-1))
    assert torch.equal(best, torch.tensor(draft_vocab)[ref[..., draft_vocab].argmax(-1)])
    assert torch.all(best % 2 == 0)
    mapped = model.heads.to_draft_ids(torch.tensor([0, 1, 4, -100]))
    assert mapped.tolist() == [0, -100, 2, -100]
    assert torch.isfinite(out.loss)


def test_own_projection(arch, tmp_path):
    base = tiny_base(arch)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2, tie_head_projection=False)
    ids = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).head_logits[:, 1], base(ids).logits, rtol=1e-5, atol=1e-5)
    model.freeze_base()
    lm_head = base.get_output_embeddings().weight.detach().clone()
    train_heads(model, steps=3)
    assert torch.equal(base.get_output_embeddings().weight, lm_head)
    assert not torch.equal(model.heads.heads[0].projection.weight, lm_head)
    model.save_pretrained(tmp_path)
    assert "heads.0.projection.weight" in load_file(tmp_path / "heads.safetensors")


def test_layers_are_not_tied():
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=2, num_layers_per_head=3)
    blocks = [b for head in model.heads.heads for b in head.blocks]
    assert len({id(b.linear.weight) for b in blocks}) == 6


def test_plain_generate_equals_base(arch):
    base = tiny_base(arch)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    ids = batch(3, (1, 7))
    expected = base.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None), expected)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, use_heads=False),
                       expected)


# ---------------------------------------------------------------- bad input
def _one_line(err):
    return "\n" not in str(err.value)


def test_fingerprint_mismatch(tmp_path):
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("llama", seed=0), num_heads=2)
    model.save_pretrained(tmp_path)
    other = tiny_base("llama", seed=1)
    with pytest.raises(BaseModelError, match="trained on another base model") as err:
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=other)
    assert _one_line(err) and "ignore_fingerprint_mismatch=True" in str(err.value)
    forced = BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=other, ignore_fingerprint_mismatch=True)
    assert forced.base_lm is other


def test_fingerprint_is_dtype_independent_and_sensitive():
    base = tiny_base("qwen2")
    fp = hf_bpd.fingerprint(base)
    assert hf_bpd.fingerprint(tiny_base("qwen2").to(torch.bfloat16)) == fp
    with torch.no_grad():
        base.get_input_embeddings().weight[0, 0] += 1.0
    assert hf_bpd.fingerprint(base) != fp


def test_missing_and_corrupt_heads_file(tmp_path):
    base = tiny_base("gpt2")
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    model.save_pretrained(tmp_path)
    (tmp_path / "heads.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="corrupt or not a safetensors file") as err:
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=base)
    assert _one_line(err)
    (tmp_path / "heads.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no heads.safetensors") as err:
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=base)
    assert _one_line(err)
    with pytest.raises(CheckpointError, match="not a directory"):
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "nope", base_model=base)


def test_config_that_disagrees_with_weights(tmp_path):
    base = tiny_base("llama")
    BlockwiseParallelForCausalLM.from_base(base, num_heads=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_heads"] = 3
    config["head_loss_weights"] = [1.0, 1.0, 1.0]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="disagrees with its config.json") as err:
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=base)
    assert _one_line(err)
    config.update(num_heads=2, head_loss_weights=[1.0, 1.0], head_type="ffn")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="disagrees with its config.json"):
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=base)


def test_base_of_another_size_is_rejected(tmp_path):
    BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=2).save_pretrained(tmp_path)
    bigger = AutoModelForCausalLM.from_config(
        type(tiny_base("llama").config)(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)
    )
    with pytest.raises(BaseModelError, match="hidden_size=32 but the base model has 48") as err:
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path, base_model=bigger, ignore_fingerprint_mismatch=True)
    assert _one_line(err)


@pytest.mark.parametrize(
    "make",
    [
        lambda: BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=4, intermediate_size=64)),
        lambda: T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                    num_heads=4)),
        lambda: torch.nn.Linear(3, 3),
    ],
    ids=["bert-mlm", "t5", "not-a-model"],
)
def test_non_causal_base_is_rejected(make):
    with pytest.raises(BaseModelError) as err:
        BlockwiseParallelForCausalLM.from_base(make(), num_heads=2)
    assert _one_line(err)
    assert "AutoModelForCausalLM.from_pretrained" in str(err.value)


def test_bad_head_settings_through_from_base():
    with pytest.raises(hf_bpd.BPDConfigError, match="num_heads must be"):
        BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=0)
    with pytest.raises(hf_bpd.BPDConfigError, match="unknown head_type"):
        BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), head_type="lstm")
    with pytest.raises(hf_bpd.BPDConfigError, match="outside the base vocabulary"):
        BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), draft_vocab=[0, VOCAB + 5])


def test_a_config_asking_for_huge_heads_fails_at_once_before_the_base_loads(tmp_path, monkeypatch):
    """The heads' sizes are checked against the safetensors header before anything is allocated or the base is
    loaded: 10^9-wide heads (a 10^14-parameter allocation) fail in under a second with one line."""
    import time

    from hf_bpd import modeling

    base = tiny_base("llama")
    BlockwiseParallelForCausalLM.from_base(base, num_heads=2, head_type="ffn").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["head_intermediate_size"] = 10 ** 9
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(modeling, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded first"))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="disagrees with its config.json") as err:
        BlockwiseParallelForCausalLM.from_pretrained(tmp_path)
    assert time.perf_counter() - start < 1.0 and _one_line(err)
