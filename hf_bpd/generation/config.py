"""Drafting options are generation options: `BlockwiseGenerationConfig` (saved as `generation_config.json`).

| field | default | meaning |
| --- | --- | --- |
| `use_heads` | `True` | `False` decodes plainly with the base (no drafting option may then be set) |
| `rescorer` | `None` | `None`/`"none"`: the heads' scores; a rescorer's name (`hf_bpd.available_rescorers()`), the checkpoint's bundled one of that name; or a `hf_bpd.Rescorer` (per call only) |
| `draft_top_k` | `None` | lattice width k (None: 1 for plain BPD, 16 when rescoring or verifying several drafts) |
| `num_drafts` | `1` | p: drafts verified together per step (> 1: tree verification) |
| `num_heads_to_use` | `None` | draft with only the first heads (None: all) |
| `tree` | `None` | Medusa-style tree: top-k widths per head (`"4,2,2,1"`, `(4, 2, 2, 1)`) or rank paths (`[(0,), (1,), (0, 0)]`) |
| `draft_nodes` | `None` | a budget of draft tokens per verification: the drafts (the `num_drafts` best paths, prompt lookup's copy) compete for it best-first, likeliest-to-be-accepted node first (calibrated head confidences), so every step verifies one block of `1 + draft_nodes` tokens. None: every drafted token is verified (a compiled chain with `prompt_lookup` shares 7 nodes with the copy) |
| `prompt_lookup` | `False` | also draft the context's continuation of its last n-gram (prompt lookup) and verify it with the heads' drafts in the same pass (`hf_bpd.generation.lookup`) |
| `heads_int8` | `None` | the heads step with int8 weights (one fp32 scale per row) in a C++ kernel on CPU, a quarter of the bytes each drafted step reads (`hf_bpd.runtime.int8_heads`); only the drafts can change, the output stays the base's. None: on with `compile=True` on a CPU, else off; True: also eagerly; False: never |
| `drafter` | `"heads"` | what drafts: `"heads"` (the drafting heads, with the options above) or `"feature"` (the checkpoint's feature-level drafter, `hf_bpd.generation.feature_drafting`: a chain of `draft_depth` tokens, plus prompt lookup's copy; one prompt at a time; the heads' options do not apply) |
| `draft_depth` | `None` | the feature-level drafter's chain length (None: 4) |
| `draft_schedule` | `"fixed"` | `"fixed"`: verify every drafted token; `"cost"`: per step, verify only the drafted tokens expected to pay for their verification cost (calibrated head confidences x the machine's measured forward costs; `hf_bpd.generation.controller`); `"switch"`: verify every drafted token, but decode plain one-token steps while this call's drafted steps yield fewer tokens per ms than plain ones would, probing now and then with unverified drafts (`hf_bpd.generation.controller`) |
| `compile` | `False` | verify with a compiled step on a reused static cache (`hf_bpd.generation.verify`); with `use_heads=False` too, for compiled plain decoding. On a CPU the step is built once per machine (`hf-bpd compile`); a call never waits for it: while it is missing it is built in the background and the call verifies eagerly. `"wait"`: build it in the call if need be (benchmarks). Elsewhere (GPUs, or prebuilt steps turned off: docs/reliability.md) `torch.compile` compiles in the first calls. Batches (fp32, and bf16 / int8 weights on hf_bpd's CPU kernels) compile only with `"wait"`: each rows × block-width shape in the call that first meets it (`hf_bpd.runtime.execution.batch_runner`) |
| `tie_margin` | `None` | greedy: a decoded token whose two best scores are closer than this × max(1, |best|) is decided by the base's own eager `generate()` (`hf_bpd.generation.near_ties`); None: 5e-5 for fp32 bases, 0 (never) for half precision |

Set them once (`model.generation_config.rescorer = "ngram"`, saved with the checkpoint) or per call
(`model.generate(..., rescorer="ngram")`); a per-call value wins.
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path

from transformers import GenerationConfig

from ..errors import BPDConfigError, BPDTypeError, CheckpointError
from ..limits import MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, MAX_NUM_DRAFTS  # noqa: F401 - the documented ceilings

DRAFTING_DEFAULTS = {"rescorer": None, "draft_top_k": None, "num_drafts": 1, "num_heads_to_use": None, "tree": None,
                     "prompt_lookup": False, "draft_schedule": "fixed", "draft_nodes": None, "heads_int8": None,
                     "drafter": "heads", "draft_depth": None}
DRAFTING_OPTIONS = tuple(DRAFTING_DEFAULTS)
DECODING_DEFAULTS = {"use_heads": True, "compile": False, "tie_margin": None}  # how the loop runs, drafting or not
DECODING_OPTIONS = tuple(DECODING_DEFAULTS)

SCHEDULES = ("fixed", "cost", "switch")  # draft_schedule values (`hf_bpd.generation.controller`)


class BlockwiseGenerationConfig(GenerationConfig):
    """A `GenerationConfig` with the drafting options above as documented fields."""

    def __init__(self, **kwargs):
        for name, default in {**DECODING_DEFAULTS, **DRAFTING_DEFAULTS}.items():
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
    compile: bool | str = False
    tie_margin: float | None = None
    rescorer: object = None
    draft_top_k: int | None = None
    num_drafts: int = 1
    num_heads_to_use: int | None = None
    tree: object = None
    prompt_lookup: bool = False
    draft_schedule: str = "fixed"
    draft_nodes: int | None = None
    heads_int8: bool | None = None
    drafter: str = "heads"
    draft_depth: int | None = None
    explicit: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # the explicit ones whose value differs from the configs' (a default is no change)


def drafting_options(kwargs: dict, generation_config: GenerationConfig | None,
                     model_config: GenerationConfig) -> DraftingOptions:
    """Pop the drafting options from `generate()`'s `kwargs` and merge them (see `DraftingOptions`).

    `use_heads=False` together with a drafting option set per call is an error: the option would be ignored.
    """
    explicit = {name: kwargs.pop(name) for name in DECODING_OPTIONS + DRAFTING_OPTIONS if name in kwargs}
    values, configured = {}, {}
    for name, default in {**DECODING_DEFAULTS, **DRAFTING_DEFAULTS}.items():
        if generation_config is not None and hasattr(generation_config, name):
            configured[name] = getattr(generation_config, name)
        else:
            configured[name] = getattr(model_config, name, default)
        values[name] = explicit[name] if name in explicit else configured[name]
    changed = tuple(n for n in explicit if not _same(explicit[n], configured[n]))
    values = validate_drafting_values(values)
    if values["use_heads"] is False:
        given = [n for n in DRAFTING_OPTIONS if n in explicit]
        if given:
            raise BPDConfigError(f"use_heads=False decodes without drafting, so {', '.join(given)} would be ignored: "
                                 "drop them, or drop use_heads=False")
    if values["tree"] is not None and values["draft_nodes"] is not None:  # a per-call value wins over a config's
        if "tree" in explicit and "draft_nodes" not in explicit:
            values["draft_nodes"] = None
        elif "draft_nodes" in explicit and "tree" not in explicit:
            values["tree"] = None
        else:
            raise BPDConfigError("tree= fixes the verified nodes itself, so draft_nodes would be ignored: pass "
                                 "draft_nodes=None with a tree, or tree=None (the p-best paths compete for "
                                 "draft_nodes)")
    if values["drafter"] == "feature":
        given = [n for n in ("rescorer", "draft_top_k", "num_drafts", "num_heads_to_use", "tree", "draft_nodes",
                             "heads_int8") if n in explicit and explicit[n] is not None]
        if given or explicit.get("draft_schedule", "fixed") != "fixed":
            raise BPDConfigError(f"drafter='feature' drafts a chain with the feature-level drafter, so "
                                 f"{', '.join(given) or 'draft_schedule'} would be ignored: drop them, or pass "
                                 "drafter='heads'")
    elif "draft_depth" in explicit and explicit["draft_depth"] is not None:
        raise BPDConfigError("draft_depth sets the feature-level drafter's chain length: pass drafter='feature' "
                             "with it, or drop it (the heads draft num_heads_to_use tokens)")
    if values["tree"] is not None and "num_drafts" in explicit and values["num_drafts"] != 1:
        raise BPDConfigError(f"tree= drafts the tree's rank paths, so num_drafts={values['num_drafts']} would be "
                             "ignored: drop num_drafts, or pass tree=None (p-best drafts)")
    return DraftingOptions(**values, explicit=tuple(explicit), changed=changed)


def _same(given, configured) -> bool:
    """Whether a call's option value is the configs' (lists and tuples alike: a tree read from JSON is a list)."""
    if isinstance(given, (list, tuple)) and isinstance(configured, (list, tuple)):
        return len(given) == len(configured) and all(_same(a, b) for a, b in zip(given, configured))
    try:
        return type(given) is type(configured) and bool(given == configured)
    except Exception:  # noqa: BLE001 - a rescorer instance or tensor compares as not the same
        return given is configured


def _int_value(name: str, value, low: int, high: int | None, where: str = "") -> int:
    """`value` as an int in [low, high] (bools refused; numpy / 0-d tensor integers accepted), else a one-line
    error naming the option, the range and an example."""
    bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise BPDTypeError(f"{where}{name} must be an integer {bound}, got {value!r} "
                           f"({type(value).__name__}): pass e.g. {name}={low}") from None
    if number < low or (high is not None and number > high):
        raise BPDConfigError(f"{where}{name} must be an integer {bound}, got {value!r}: pass a value in that "
                             "range")
    return number


def validate_drafting_values(values: dict, where: str = "") -> dict:
    """Check the drafting options in `values` that need no model (types, ranges, names; the ones that depend on
    the heads are checked by `decoding.plan_drafting`); returns them with integers normalised. `where` prefixes
    every message (e.g. the file the values came from)."""
    out = dict(values)
    for name in ("use_heads", "compile", "prompt_lookup"):
        if name in out and not isinstance(out[name], bool) and not (name == "compile" and out[name] == "wait"):
            also = " (or compile='wait')" if name == "compile" else ""
            raise BPDTypeError(f"{where}{name} must be True or False{also}, got {out[name]!r}: pass {name}=True or "
                               f"{name}=False")
    if out.get("heads_int8") is not None and not isinstance(out["heads_int8"], bool):
        raise BPDTypeError(f"{where}heads_int8 must be True, False or None, got {out['heads_int8']!r}: pass "
                           "heads_int8=False for the heads' own fp32 weights")
    margin = out.get("tie_margin")
    if margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) \
                or margin < 0:
            raise BPDConfigError(f"{where}tie_margin must be a number >= 0 (or None for the default), got "
                                 f"{margin!r}: pass e.g. tie_margin=1e-4, or 0 to never re-decide near-ties")
        out["tie_margin"] = float(margin)
    if out.get("draft_top_k") is not None:
        out["draft_top_k"] = _int_value("draft_top_k", out["draft_top_k"], 1, MAX_DRAFT_TOP_K, where)
    if "num_drafts" in out:
        out["num_drafts"] = _int_value("num_drafts", out["num_drafts"], 1, MAX_NUM_DRAFTS, where)
    if out.get("draft_nodes") is not None:
        out["draft_nodes"] = _int_value("draft_nodes", out["draft_nodes"], 1, MAX_DRAFT_NODES, where)
    if "drafter" in out and out["drafter"] not in ("heads", "feature"):
        raise BPDConfigError(f"{where}drafter must be 'heads' or 'feature', got {out['drafter']!r}: pass "
                             "drafter='heads' (the drafting heads) or 'feature' (the feature-level drafter)")
    if out.get("draft_depth") is not None:
        out["draft_depth"] = _int_value("draft_depth", out["draft_depth"], 1, 32, where)
    if out.get("num_heads_to_use") is not None:
        out["num_heads_to_use"] = _int_value("num_heads_to_use", out["num_heads_to_use"], 1, None, where)
    if "draft_schedule" in out and out["draft_schedule"] not in SCHEDULES:
        raise BPDConfigError(f"{where}draft_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got "
                             f"{out['draft_schedule']!r}: pass draft_schedule='fixed' (every drafted token), "
                             "'cost' or 'switch'")
    rescorer = out.get("rescorer")
    if rescorer is not None and not isinstance(rescorer, str):
        from ..rescorers.base import Rescorer

        if not isinstance(rescorer, Rescorer):
            raise BPDTypeError(f"{where}rescorer must be a rescorer's name (hf_bpd.available_rescorers()), 'none', "
                               f"None or a hf_bpd.Rescorer instance, got {type(rescorer).__name__}")
    tree = out.get("tree")
    if tree is not None:
        if not isinstance(tree, (str, list, tuple)):
            raise BPDTypeError(f"{where}tree must be widths per head ('4,2,2,1' or (4, 2, 2, 1)) or rank paths "
                               f"([(0,), (1,), (0, 0)]), got {type(tree).__name__}")
        if len(tree) > (8 * MAX_DRAFT_NODES if isinstance(tree, str) else MAX_DRAFT_NODES):
            raise BPDConfigError(f"{where}tree has {len(tree)} entries, over the ceiling of {MAX_DRAFT_NODES} nodes "
                                 "per verification: prune it")
    return out


def load_generation_config(directory: Path, base_model, config) -> BlockwiseGenerationConfig:
    """`generation_config.json` of the checkpoint (drafting options included), else the base's; decoding settings
    that old checkpoints kept in config.json are moved here."""
    path = directory / "generation_config.json"
    if path.exists():
        try:
            values = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path} is not valid JSON ({getattr(err, 'msg', err)}): restore it, or delete it "
                                  "to use the base's generation settings") from None
        if not isinstance(values, dict):
            raise CheckpointError(f"{path} must hold a JSON object of generation settings: restore it, or delete it")
        values.pop("transformers_version", None)
        validate_drafting_values({k: v for k, v in values.items() if k in DRAFTING_OPTIONS + DECODING_OPTIONS},
                                 where=f"{path}: ")
        try:
            generation_config = BlockwiseGenerationConfig(**values)
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"{path} holds invalid generation settings ({str(err).strip().splitlines()[0]}): "
                                  "fix or delete it") from None
    else:
        generation_config = BlockwiseGenerationConfig.from_base(base_model.generation_config)
    for name, value in config.legacy_generation_options.items():
        if value is not None and name not in json.loads(path.read_text() if path.exists() else "{}"):
            setattr(generation_config, name, value)
    return generation_config
