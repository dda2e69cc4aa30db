"""Drafting options are generation options: `BlockwiseGenerationConfig` (saved as `generation_config.json`).

| field | default | meaning |
| --- | --- | --- |
| `use_heads` | `True` | `False` decodes plainly with the base (no drafting option may then be set) |
| `rescorer` | `None` | `None`/`"none"`: the heads' scores; a registered name (`hf_bpd.available_rescorers()`), the checkpoint's bundled one of that name; or a `hf_bpd.Rescorer` (per call only) |
| `draft_top_k` | `None` | lattice width k (None: 1 for plain BPD, 16 when rescoring or verifying several drafts) |
| `num_drafts` | `1` | p: drafts verified together per step (> 1: tree verification) |
| `num_heads_to_use` | `None` | draft with only the first heads (None: all) |
| `tree` | `None` | Medusa-style tree: top-k widths per head (`"4,2,2,1"`, `(4, 2, 2, 1)`) or rank paths (`[(0,), (1,), (0, 0)]`) |
| `prompt_lookup` | `False` | also draft the context's continuation of its last n-gram (prompt lookup) and verify it with the heads' drafts in the same pass (`hf_bpd.generation.lookup`) |
| `draft_schedule` | `"fixed"` | `"fixed"`: verify every drafted token; `"cost"`: per step, verify only the drafted tokens expected to pay for their verification cost (calibrated head confidences x the machine's measured forward costs; `hf_bpd.generation.budget`) |
| `compile` | `False` | verify with a `torch.compile`d step on a reused static cache (`hf_bpd.generation.verify`); with `use_heads=False` too, for compiled plain decoding |

Set them once (`model.generation_config.rescorer = "ngram"`, saved with the checkpoint) or per call
(`model.generate(..., rescorer="ngram")`); a per-call value wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import GenerationConfig

from ..errors import BPDConfigError

DRAFTING_DEFAULTS = {"rescorer": None, "draft_top_k": None, "num_drafts": 1, "num_heads_to_use": None, "tree": None,
                     "prompt_lookup": False, "draft_schedule": "fixed"}
DRAFTING_OPTIONS = tuple(DRAFTING_DEFAULTS)


class BlockwiseGenerationConfig(GenerationConfig):
    """A `GenerationConfig` with the drafting options above as documented fields."""

    def __init__(self, **kwargs):
        self.use_heads = kwargs.pop("use_heads", True)
        self.compile = kwargs.pop("compile", False)
        for name, default in DRAFTING_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(**kwargs)

    @classmethod
    def from_base(cls, base_config: GenerationConfig | None, **drafting) -> BlockwiseGenerationConfig:
        """The base's generation settings (eos, pad, sampling defaults) plus drafting options."""
        values = {} if base_config is None else base_config.to_dict()
        values.pop("transformers_version", None)
        values.pop("_from_model_config", None)  # ours: transformers must not rebuild it from the model config
        values.update(drafting)
        return cls(**values)

    def to_dict(self) -> dict:
        out = super().to_dict()
        if isinstance(out.get("tree"), (list, tuple)):  # JSON has no tuples
            out["tree"] = [list(path) if isinstance(path, tuple) else path for path in out["tree"]]
        return out


@dataclass(frozen=True)
class DraftingOptions:
    """The drafting options of one `generate()` call, after per-call values, the passed generation config and the
    model's generation config were merged (in that order). `explicit` names the ones set per call."""

    use_heads: bool = True
    compile: bool = False
    rescorer: object = None
    draft_top_k: int | None = None
    num_drafts: int = 1
    num_heads_to_use: int | None = None
    tree: object = None
    prompt_lookup: bool = False
    draft_schedule: str = "fixed"
    explicit: tuple[str, ...] = ()


def drafting_options(kwargs: dict, generation_config: GenerationConfig | None,
                     model_config: GenerationConfig) -> DraftingOptions:
    """Pop the drafting options from `generate()`'s `kwargs` and merge them (see `DraftingOptions`).

    `use_heads=False` together with a drafting option set per call is an error: the option would be ignored.
    """
    explicit = {name: kwargs.pop(name) for name in ("use_heads", "compile") + DRAFTING_OPTIONS if name in kwargs}
    values = {}
    for name, default in {"use_heads": True, "compile": False, **DRAFTING_DEFAULTS}.items():
        if name in explicit:
            values[name] = explicit[name]
        elif generation_config is not None and hasattr(generation_config, name):
            values[name] = getattr(generation_config, name)
        else:
            values[name] = getattr(model_config, name, default)
    for name in ("use_heads", "compile"):
        if not isinstance(values[name], bool):
            raise BPDConfigError(f"{name} must be True or False, got {values[name]!r}")
    if values["use_heads"] is False:
        given = [n for n in DRAFTING_OPTIONS if n in explicit]
        if given:
            raise BPDConfigError(f"use_heads=False decodes without drafting, so {', '.join(given)} would be ignored: "
                                 "drop them, or drop use_heads=False")
    return DraftingOptions(**values, explicit=tuple(explicit))


def load_generation_config(directory: Path, base_model, config) -> BlockwiseGenerationConfig:
    """`generation_config.json` of the checkpoint (drafting options included), else the base's; decoding settings
    that old checkpoints kept in config.json are moved here."""
    path = directory / "generation_config.json"
    if path.exists():
        values = json.loads(path.read_text())
        values.pop("transformers_version", None)
        generation_config = BlockwiseGenerationConfig(**values)
    else:
        generation_config = BlockwiseGenerationConfig.from_base(base_model.generation_config)
    for name, value in config.legacy_generation_options.items():
        if value is not None and name not in json.loads(path.read_text() if path.exists() else "{}"):
            setattr(generation_config, name, value)
    return generation_config
