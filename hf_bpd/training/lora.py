"""LoRA for heads and base through peft (Medusa-1: heads only; Medusa-2: base LoRA trained jointly with heads)."""

from __future__ import annotations

from peft import LoraConfig

HEAD_LINEAR_PATTERN = r"heads\.heads\.\d+\.blocks\.\d+\.(linear|up|down)"


def bpd_lora_config(
    model,
    r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    heads: str = "lora",
    base_target_modules: list[str] | None = None,
) -> LoraConfig:
    """A `peft.LoraConfig` for a `BlockwiseParallelForCausalLM`; pass it to `peft.get_peft_model(model, config)`.

    Args:
        heads: `"lora"` adapts the heads' linear layers with LoRA; `"full"` trains every head parameter
            (peft `modules_to_save`); `"frozen"` leaves the heads as they are.
        base_target_modules: base module names to adapt with LoRA (e.g. `["q_proj", "v_proj"]`): Medusa-2 style
            joint training. Keep the base's next-token loss (`base_loss_weight`) so its outputs do not drift.
    """
    if heads not in ("lora", "full", "frozen"):
        raise ValueError(f"heads must be 'lora', 'full' or 'frozen', got {heads!r}")
    if heads != "lora" and not base_target_modules:
        raise ValueError("nothing to adapt with LoRA: pass heads='lora' or base_target_modules=[...]")
    patterns = [HEAD_LINEAR_PATTERN] if heads == "lora" else []
    if base_target_modules:
        names = "|".join(base_target_modules)
        patterns.append(rf"base_lm\..*\.({names})")
    modules_to_save = None
    if heads == "full":
        modules_to_save = ["blocks"] + ([] if model.config.tie_head_projection else ["projection"])
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules="^(" + "|".join(patterns) + ")$",
        modules_to_save=modules_to_save,
    )


def save_base_adapter(peft_model, directory) -> None:
    """Save only the base model's LoRA (Medusa-2 mode) as a standalone peft adapter for the base.

    `BlockwiseParallelForCausalLM.from_pretrained` merges it into the named base (after checking the base's
    fingerprint) when the checkpoint's config sets `base_adapter`.
    """
    from pathlib import Path

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    prefix = "base_model.model.base_lm."
    state = {k.replace(prefix, "base_model.model."): v.detach().contiguous().cpu()
             for k, v in get_peft_model_state_dict(peft_model).items() if k.startswith(prefix) and "lora_" in k}
    config = peft_model.peft_config["default"]
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=config.r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
               target_modules=targets).save_pretrained(directory)
    save_file(state, directory / "adapter_model.safetensors")
