"""Export trained heads to serving engines' formats. One format today: vLLM's Medusa draft model (`vllm-medusa`).

vLLM's Medusa (`vllm/model_executor/models/medusa.py`, config `vllm/transformers_utils/configs/medusa.py`) runs, per
head `i`, `num_hidden_layers` residual blocks `x = x + SiLU(W x + b)` on the base's last hidden state (the input of
its output layer), then an LM head (`original_lm_head`: one shared matrix, else one per head) times `logit_scale`;
with `truncated_vocab_size` < `vocab_size` the head scores only the ids of the `token_map` tensor and the other ids
get -inf. It proposes each head's top-1 token. hf_bpd's `"resblock"` heads are exactly those blocks (their `Linear`
has a bias: `medusa_fc_bias`), a tied projection is `original_lm_head`, and a draft vocabulary is the token map. FFN
and hydra heads have no counterpart (`x + W2 ReLU(W1 x)`, and token inputs): exporting them is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import BPDConfigError

EXPORT_FORMATS = ("vllm-medusa",)


def check_exportable(head_type: str) -> None:
    """`BPDConfigError` unless heads of `head_type` have a Medusa form (the command line checks config.json's
    head_type with it before loading the base; this module imports nothing heavy until it writes)."""
    if head_type != "resblock":
        raise BPDConfigError(f"{head_type} heads cannot be exported to vLLM's Medusa format, which has only "
                             "residual x + SiLU(W x) blocks: train heads with --head-type resblock to serve them with "
                             "vLLM")


def medusa_state(model) -> tuple[dict, dict]:
    """`(config, tensors)` of `model`'s heads in vLLM's Medusa format; `BPDConfigError` when they cannot be."""
    config, heads = model.config, model.heads
    check_exportable(config.head_type)
    output_layer = model.base_lm.get_output_embeddings()
    if config.tie_head_projection and getattr(output_layer, "bias", None) is not None:
        raise BPDConfigError("the base's output layer has a bias, which vLLM's Medusa LM head does not: these heads "
                             "cannot be exported")
    tensors = {}
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            tensors[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight
            tensors[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias
        if head.projection is not None:
            tensors[f"lm_heads.{i}.weight"] = head.projection.weight
    if config.tie_head_projection:  # one shared LM head: the base's output layer, on the draft vocabulary's rows
        weight = output_layer.weight
        if heads.draft_vocab is not None:
            weight = weight.index_select(0, heads.draft_vocab.to(weight.device))
        tensors["lm_heads.0.weight"] = weight
    if heads.draft_vocab is not None:
        tensors["token_map"] = heads.draft_vocab
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    medusa_config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers_per_head,
        "truncated_vocab_size": config.draft_size,
        "original_lm_head": bool(config.tie_head_projection),
        "medusa_fc_bias": True,
        "logit_scale": 1.0,
    }
    return medusa_config, tensors


def export_heads(model, output_dir: str | Path, format: str = "vllm-medusa") -> Path:
    """Write `model`'s heads to `output_dir` in `format` (`EXPORT_FORMATS`): `config.json` and `model.safetensors`."""
    if format not in EXPORT_FORMATS:
        raise BPDConfigError(f"unknown export format {format!r}: use one of {', '.join(EXPORT_FORMATS)}")
    from safetensors.torch import save_file

    medusa_config, tensors = medusa_state(model)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(medusa_config, indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
