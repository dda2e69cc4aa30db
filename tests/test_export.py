"""`hf-bpd export --format vllm-medusa`: the files alone, read the way vLLM's Medusa model reads them, draft the same
tokens as hf_bpd's heads; heads with no Medusa form are refused."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_bpd import BlockwiseParallelForCausalLM, BPDConfigError
from hf_bpd.cli import main
from hf_bpd.hub.export import export_heads
from tests.conftest import VOCAB, tiny_base


def trained_like(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.heads.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.3 if "projection" not in name else 1.0))
    return model.eval()


def vllm_medusa_proposals(directory, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa forward (model_executor/models/medusa.py) re-implemented from the exported files only:
    per head, `x = x + SiLU(layer(x))` over its layers, the LM head (shared with `original_lm_head`) times
    `logit_scale`, scattered into the full vocabulary through `token_map` (-inf elsewhere), top-1.
    Returns `(num_heads, positions)` token ids."""
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert not {"num_attention_heads", "text_config", "rope_theta"} & set(config)  # no base-model fields
    token_map = tensors.get("token_map")
    assert (token_map is not None) == (config["truncated_vocab_size"] < config["vocab_size"])
    proposals = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            bias = tensors[f"blocks.{i}.layers.{j}.bias"] if config["medusa_fc_bias"] else None
            x = x + torch.nn.functional.silu(torch.nn.functional.linear(x, tensors[f"blocks.{i}.layers.{j}.weight"],
                                                                          bias))
        head = tensors["lm_heads.0.weight" if config["original_lm_head"] else f"lm_heads.{i}.weight"]
        if token_map is not None and head.shape[0] > token_map.shape[0]:
            head = head[token_map]  # vLLM's load_weights cuts a full-vocabulary LM head to the token map
        logits = (x @ head.T) * config.get("logit_scale", 1.0)
        if token_map is not None:
            full = torch.full((*logits.shape[:-1], config["vocab_size"]), -torch.inf)
            full[..., token_map] = logits
            logits = full
        proposals.append(logits.argmax(-1))
    return torch.stack(proposals)


@pytest.mark.parametrize("draft_vocab", [None, list(range(0, VOCAB, 2))])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layers", [1, 2])
def test_exported_medusa_heads_draft_what_hf_bpd_drafts(tmp_path, draft_vocab, tied, layers):
    model = trained_like(BlockwiseParallelForCausalLM.from_base(
        tiny_base("llama"), num_heads=3, head_type="resblock", num_layers_per_head=layers,
        tie_head_projection=tied, draft_vocab=draft_vocab))
    export_heads(model, tmp_path)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model(ids, return_head_logits=False).last_hidden_state[0]  # the input of the base's output layer
        ours = torch.stack([model.heads.to_vocab_ids(model.heads.step_logits(h).argmax(-1)) for h in hidden], dim=1)
    theirs = vllm_medusa_proposals(tmp_path, hidden)
    assert torch.equal(ours, theirs)
    assert len(set(theirs.flatten().tolist())) > 3  # the heads say different things: the comparison can fail


@pytest.mark.parametrize("head_type", ["ffn", "hydra"])
def test_heads_without_a_medusa_form_are_refused(tmp_path, head_type):
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=2, head_type=head_type)
    with pytest.raises(BPDConfigError, match="--head-type resblock"):
        export_heads(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_command(tmp_path, capsys):
    base_dir, ckpt = tmp_path / "base", tmp_path / "heads"
    tiny_base("llama").save_pretrained(base_dir)
    model = trained_like(BlockwiseParallelForCausalLM.from_base(str(base_dir), num_heads=2, head_type="resblock"))
    model.save_pretrained(ckpt)
    assert main(["export", str(ckpt), "--format", "vllm-medusa", "--output", str(tmp_path / "medusa")]) == 0
    assert "wrote vllm-medusa heads" in capsys.readouterr().out
    assert json.loads((tmp_path / "medusa" / "config.json").read_text())["num_heads"] == 2

    BlockwiseParallelForCausalLM.from_base(str(base_dir), num_heads=2, head_type="ffn").save_pretrained(tmp_path / "f")
    assert main(["export", str(tmp_path / "f"), "--output", str(tmp_path / "m2")]) == 2
    assert "ffn heads cannot be exported" in capsys.readouterr().err


def test_the_shipped_resblock_checkpoint_exports_and_drafts_the_same(tmp_path):
    """The second shipped checkpoint (resblock heads for SmolLM2): exported, vLLM's Medusa forward on SmolLM2's real
    hidden states proposes what hf_bpd's heads propose."""
    from pathlib import Path

    checkpoint = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-bpd-resblock"
    assert main(["export", str(checkpoint), "--output", str(tmp_path / "medusa"), "--threads", "2"]) == 0
    model = BlockwiseParallelForCausalLM.from_pretrained(checkpoint)
    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert config["truncated_vocab_size"] == 8192 < config["vocab_size"] and config["original_lm_head"] is True
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 7018, 314, 2, 198, 1]])
    with torch.no_grad():
        hidden = model(ids, return_head_logits=False).last_hidden_state[0]
        ours = torch.stack([model.heads.to_vocab_ids(model.heads.step_logits(h).argmax(-1)) for h in hidden], dim=1)
    assert torch.equal(ours, vllm_medusa_proposals(tmp_path / "medusa", hidden))
    out = model.generate(ids, max_new_tokens=24, do_sample=False)  # and it decodes exactly, drafting
    assert torch.equal(out, model.base_lm.generate(ids, max_new_tokens=24, do_sample=False))
    assert model.last_generation_stats.block_efficiency > 1.0
