"""Model cards for saved heads, rendered from `model_cards/template.md` (installed as `hf_bpd.model_cards`)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from string import Template

from ..generation.config import DRAFTING_OPTIONS
from ..rescorers.registry import available_rescorers


def hub_base_id(name: str | None) -> str | None:
    """The Hub id of a base named by a packaged alias (its original model) or by a Hub id; None for local paths."""
    from .remote_code import base_model_hub_id

    name = base_model_hub_id(name)
    if name and name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists():
        return name
    return None


def card_metadata(model, directory: Path | None = None):
    """The card's YAML front matter (`huggingface_hub.ModelCardData`): base_model (a Hub id), library_name,
    pipeline_tag, tags, datasets (training.json's `datasets`: Hub ids of the training data's sources) and
    model-index results measured for these heads: per-head top-1/top-5 accuracy on the held-out split
    (training.json) and block efficiency of plain and rescored drafts on held-out prompts (tuning.json)."""
    import json

    from huggingface_hub import EvalResult, ModelCardData

    config = model.config
    training = tuning = {}
    if directory is not None and (directory / "training.json").exists():
        training = json.loads((directory / "training.json").read_text())
    if directory is not None and (directory / "tuning.json").exists():
        tuning = json.loads((directory / "tuning.json").read_text())
    results = []
    split = "held-out split of the training conversations"
    for row in training.get("eval_head_accuracy", []):
        for metric in ("top1", "top5"):
            results.append(EvalResult(
                task_type="text-generation", dataset_type="hf_bpd/heads-eval-split", dataset_name=split,
                metric_type=f"head{row['head']}_{metric}_accuracy", metric_value=round(row[metric], 4),
                metric_name=f"head {row['head']} {metric[:3]}-{metric[3:]} accuracy (predicts token t+{row['head'] + 1})",
                metric_config=f"train_heads.py, {row['positions']} positions"))
    chosen = tuning.get(tuning.get("chosen") or "", {})
    if chosen.get("block_efficiency"):
        prompts = (f"{tuning.get('prompts')} held-out prompts ({tuning.get('prompt_file')}), greedy, "
                   f"{tuning.get('max_new_tokens')} new tokens")
        how = f"hf-bpd tune-alpha, top-{tuning.get('top_k', 16)} lattice"
        for label, value in (("plain BPD (heads' argmax)", chosen["vanilla"]),
                             (f"BPD + {tuning['chosen']} rescorer, alpha={chosen.get('alpha')}",
                              chosen.get("best", max(chosen["block_efficiency"].values())))):
            results.append(EvalResult(task_type="text-generation", dataset_type="hf_bpd/tune_prompts",
                                      dataset_name=prompts, metric_type="block_efficiency",
                                      metric_value=round(value, 3), metric_name=f"block efficiency, {label}",
                                      metric_config=how))
    tags = ["hf_bpd", "blockwise-parallel-decoding", "speculative-decoding", f"{config.head_type}-heads"]
    if config.head_type == "resblock":
        tags.append("medusa")
    return ModelCardData(base_model=hub_base_id(config.base_model_name_or_path), library_name="transformers",
                         pipeline_tag="text-generation", tags=tags, datasets=training.get("datasets") or None,
                         model_name=f"BPD heads for {config.base_model_name_or_path or 'a causal LM'}",
                         eval_results=results or None)


def render_model_card(model, repo: str | None = None, extra: str = "", directory: Path | None = None) -> str:
    """Markdown model card for a `BlockwiseParallelForCausalLM`; `extra` is appended (results, training data)."""
    config = model.config
    base = config.base_model_name_or_path or "unknown"
    template = Template((files("hf_bpd.model_cards") / "template.md").read_text())
    generation = model.generation_config
    vocab = "full vocabulary" if config.draft_vocab_size is None else f"{config.draft_vocab_size} token ids"
    return template.safe_substitute(
        front_matter=card_metadata(model, directory).to_yaml(),
        title=f"BPD heads for {base}",
        base_model=base,
        base_link=f"https://huggingface.co/{hub_base_id(base)}" if hub_base_id(base) else "#",
        num_heads=config.num_heads,
        head_type=config.head_type,
        num_layers_per_head=config.num_layers_per_head,
        projection="tied to the base's output embedding" if config.tie_head_projection else "own projection",
        block_size=config.block_size,
        head_params=f"{sum(p.numel() for p in model.heads.parameters()):,}",
        fingerprint=config.base_model_fingerprint,
        draft_vocab=vocab,
        head_loss_weights=", ".join(f"{w:g}" for w in config.head_loss_weights),
        default_decoding=", ".join(f"{name}={getattr(generation, name, None)!r}"
                                   for name in (*DRAFTING_OPTIONS, "compile")),
        rescorers=", ".join(f"`{name}`" for name in available_rescorers()),
        bundled=", ".join(f"`{name}` ({spec['path']}, α={spec.get('alpha')})" for name, spec in
                          sorted(config.rescorers.items())) or "none",
        repo=repo or "path/to/this/checkpoint",
        extra=extra,
    )


def _sections(directory: Path) -> str:
    """Training settings (`training.json`) and measured results (`results.md`) found in the checkpoint directory."""
    import json

    parts = []
    training = directory / "training.json"
    if training.exists():
        info = json.loads(training.read_text())
        accuracy = info.pop("eval_head_accuracy", [])
        rows = "\n".join(f"| {k} | {v} |" for k, v in info.items())
        parts.append(f"## Training\n\n| setting | value |\n| --- | --- |\n{rows}\n")
        if accuracy:
            acc = "\n".join(f"| {a['head']} | {a['top1']:.3f} | {a['top5']:.3f} | {a['positions']} |" for a in accuracy)
            parts.append("Per-head accuracy on the held-out split (head h predicts token t+1+h):\n\n"
                         f"| head | top-1 | top-5 | positions |\n| --- | --- | --- | --- |\n{acc}\n")
    tuning = directory / "tuning.json"
    if tuning.exists():
        info = json.loads(tuning.read_text())
        rows = [(k, v) for k, v in info.items() if isinstance(v, dict) and "block_efficiency" in v]
        if rows:
            grid = list(rows[0][1]["block_efficiency"])
            head = "| rescorer | vanilla BPD | " + " | ".join(f"α={a}" for a in grid) + " |"
            lines = [head, "| --- " * (len(grid) + 2) + "|"]
            lines += [f"| {k} | {v['vanilla']:.3f} | " + " | ".join(f"{v['block_efficiency'][a]:.3f}" for a in grid)
                      + " |" for k, v in rows]
            parts.append(f"## Rescorer tuning\n\nBlock efficiency on {info.get('prompts')} held-out prompts "
                         f"({info.get('max_new_tokens')} new tokens, greedy, top-{info.get('top_k', 16)} lattice); "
                         f"bundled: `{info.get('chosen')}`.\n\n" + "\n".join(lines) + "\n")
    results = directory / "results.md"
    if results.exists():
        parts.append("## Results\n\n" + results.read_text())
    return "\n".join(parts)


def write_model_card(model, directory: str | Path, extra: str = "") -> Path:
    directory = Path(directory)
    path = directory / "README.md"
    path.write_text(render_model_card(model, extra="\n".join(x for x in (_sections(directory), extra) if x),
                                      directory=directory))
    return path
