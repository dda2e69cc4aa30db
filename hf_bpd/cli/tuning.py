"""`hf-bpd tune-alpha` (a bundled rescorer's interpolation weight) and `hf-bpd calibrate` (acceptance per head
confidence, for `draft_schedule="cost"`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..limits import MAX_DRAFT_TOP_K
from .common import (RESCORER_NAMES, _add_common, _local_checkpoint_config, _locate, _positive, _questions, _setup,
                     _writable_file, _write_config)


def _alpha_grid(text: str | None):
    if text is None:
        return None
    try:
        grid = [float(a) for a in text.replace(" ", "").split(",") if a]
    except ValueError:
        raise ValueError(f"--grid must be comma-separated numbers such as 0.1,0.5,1,2, got {text[:60]!r}") from None
    if not grid or len(grid) > 100 or any(not math.isfinite(a) or a < 0 for a in grid):
        raise ValueError(f"--grid must hold 1-100 finite numbers >= 0, got {text[:60]!r}")
    return grid


def cmd_tune_alpha(args) -> int:
    _positive(args, "limit", "max_new_tokens", "threads", "draft_top_k")
    if args.draft_top_k > MAX_DRAFT_TOP_K:
        raise ValueError(f"--draft-top-k must be in [1, {MAX_DRAFT_TOP_K}], got {args.draft_top_k}")
    grid = _alpha_grid(args.grid)
    if args.save:
        _local_checkpoint_config(args.model, "--save")
    _locate(args.model)
    questions = _questions(args)
    _writable_file(args.output)
    from ..evaluation.tuning import ALPHA_GRID, tune_alpha

    model, tokenizer = _setup(args)
    if not hasattr(model, "heads"):
        raise ValueError(f"{args.model} is a plain base model: tune-alpha needs a heads checkpoint directory")
    rescorer = getattr(model, "bundled_rescorers", {}).get(args.rescorer)
    if rescorer is None:
        raise ValueError(f"{args.model} bundles no {args.rescorer} rescorer")
    from ..evaluation.bench import encode_messages

    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], args.chat, model.device)["input_ids"]
               for q in questions]
    grid = grid or ALPHA_GRID
    result = tune_alpha(model, rescorer, prompts, args.max_new_tokens, grid, args.draft_top_k)
    rows = [("α", "block efficiency")] + [(f"{a:g}", f"{be:.3f}") for a, be in result["block_efficiency"].items()]
    report = {"rescorer": args.rescorer, "alpha": result["alpha"], "vanilla": result["vanilla"],
              "block_efficiency": result["block_efficiency"]}
    if args.rescorer == "ngram" and hasattr(rescorer, "entropy_adaptive"):
        rescorer.entropy_adaptive = True
        adaptive = tune_alpha(model, rescorer, prompts, args.max_new_tokens, grid, args.draft_top_k,
                              references=result["references"])
        rescorer.entropy_adaptive = False
        rescorer.alpha = result["alpha"]
        report["entropy_adaptive"] = {"alpha": adaptive["alpha"], "block_efficiency": adaptive["block_efficiency"]}
        rows += [(f"{a:g} (entropy-adaptive)", f"{be:.3f}") for a, be in adaptive["block_efficiency"].items()]
    print("| " + " | ".join(rows[0]) + " |\n| --- | --- |")
    print("\n".join(f"| {a} | {b} |" for a, b in rows[1:]))
    print(f"\nvanilla BPD: {result['vanilla']:.3f}; best α = {result['alpha']:g} "
          f"({result['block_efficiency'][result['alpha']]:.3f})")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    if args.save:
        config_file = _local_checkpoint_config(args.model, "--save")
        config = json.loads(config_file.read_text())
        config["rescorers"][args.rescorer]["alpha"] = result["alpha"]
        _write_config(config_file, config)
        print(f"saved α = {result['alpha']:g} to {config_file}")
    return 0


def cmd_calibrate(args) -> int:
    from ..evaluation.bench import encode_messages
    from ..evaluation.calibration import calibrate, reliability_table

    _positive(args, "limit", "max_new_tokens", "threads", "bins")
    if args.bins > 100:
        raise ValueError(f"--bins must be in [1, 100], got {args.bins}")
    questions = _questions(args)
    _writable_file(args.output)
    if args.save:
        _local_checkpoint_config(args.model, "--save")
    _locate(args.model)
    model, tokenizer = _setup(args)
    if not hasattr(model, "heads"):
        raise ValueError(f"{args.model} is a plain base model: calibrate a heads checkpoint")
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], args.chat, model.device) for q in questions]
    options = {} if args.rescorer is None else {"rescorer": args.rescorer}
    calibration, records = calibrate(model, prompts, args.max_new_tokens, args.bins, **options)
    print(reliability_table(calibration, records), end="")
    if calibration.lookup:
        print("prompt lookup's acceptance rate per copied token: " +
              ", ".join(f"{r:.2f}" for r in calibration.lookup))
    print(f"{len(records)} tried draft tokens from {len(prompts)} prompts")
    if args.output:
        Path(args.output).write_text(json.dumps({"calibration": calibration.to_dict(), "records": records}))
    if args.save:
        config_file = _local_checkpoint_config(args.model, "--save")
        config = json.loads(config_file.read_text())
        config["head_calibration"] = calibration.to_dict()
        _write_config(config_file, config)
        print(f"saved head_calibration to {config_file}")
    return 0


def add_parsers(sub, command) -> None:
    """The `calibrate` and `tune-alpha` subcommands' parsers."""
    cal = command(
        "calibrate", "measure how often each head's drafted token is accepted per confidence bin "
                     "(for draft_schedule='cost')",
        "Chain decoding on held-out prompts; prints per head and confidence bin the tries, the mean "
        "head probability and the measured acceptance rate; --save writes the fitted table into the "
        "checkpoint's config.json (head_calibration).")
    _add_common(cal, model_default=None, plot=False, progress=False)
    cal.set_defaults(questions="benchmarks/tune_prompts.jsonl", max_new_tokens=256)
    cal.add_argument("--rescorer", choices=["none", *RESCORER_NAMES], default=None,
                     help="the rescorer drafting uses (default: the checkpoint's)")
    cal.add_argument("--bins", type=int, default=10, help="confidence bins per head, 1-100")
    cal.add_argument("--save", action="store_true", help="write head_calibration into MODEL/config.json")
    cal.set_defaults(func=cmd_calibrate)
    tune = command(
        "tune-alpha", "tune a bundled rescorer's interpolation weight α for block efficiency (App. E)",
        "Generates the base's greedy continuation of held-out prompts once, then computes the block "
        "efficiency of the rescored drafts for every α of the grid (and entropy-adaptive α for the "
        "n-gram rescorer); --save writes the best α into the checkpoint's config.json.")
    _add_common(tune, model_default=None, plot=False, progress=False)
    tune.add_argument("--rescorer", choices=RESCORER_NAMES, required=True,
                      help="the bundled rescorer to tune (required)")
    tune.add_argument("--grid", default=None,
                      help="comma-separated α values >= 0 (default: the paper's grid 0.1,...,10)")
    tune.add_argument("--draft-top-k", type=int, default=16, help=f"lattice width k, 1-{MAX_DRAFT_TOP_K}")
    tune.add_argument("--save", action="store_true", help="store the chosen α in the checkpoint config")
    tune.set_defaults(func=cmd_tune_alpha)
