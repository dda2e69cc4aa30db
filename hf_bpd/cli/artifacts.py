"""`hf-bpd compile`: build a checkpoint's compiled verification step for this machine once
(`hf_bpd.runtime.artifacts`), so every later process loads it in seconds; `--list` and `--clear` manage the cache."""

from __future__ import annotations

import sys
import time

from .common import _add_dtype, _locate, _positive, load_model


def cmd_compile(args) -> int:
    from ..runtime import artifacts
    from ..runtime.batched import batched_artifact_unsupported_reason

    if args.all and not args.clear:
        raise ValueError("--all goes with --clear: hf-bpd compile --clear --all")
    if args.clear:
        print(f"removed {artifacts.clear()} artifact(s) from {artifacts.artifacts_dir()}")
        if args.all:
            print(f"removed {', '.join(_clear_rebuildable()) or 'nothing else'}")
        return 0
    if args.list:
        found = artifacts.listing()
        if not found:
            print(f"no artifacts in {artifacts.artifacts_dir()}")
        for record in found:
            if record.get("broken"):
                print(f"{record['path']}: an unreadable record (rebuilt on next use)")
                continue
            print(f"{record['path']}: {record['graph']}, {record['dtype']}, {record['cpu']}, {record['threads']} "
                  f"threads, torch {record['torch']}, weights {record['weights']}, {record['bytes'] / 1e6:.0f} MB, "
                  f"built in {record['build_seconds']:.0f} s")
        return 0
    if args.model is None:
        raise ValueError("hf-bpd compile needs a model: hf-bpd compile CHECKPOINT (or --list / --clear)")
    _positive(args, "threads")
    _locate(args.model)
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = load_model(args.model, args.dtype, quantize=args.quantize)
    base = getattr(model, "base_lm", model).eval()
    reason = artifacts.unsupported_reason(base)
    if reason is not None:
        raise ValueError(f"cannot build an artifact for {args.model}: {reason}")
    largest = _largest_block(model, args)
    log = lambda m: print(f"hf-bpd: {m}", file=sys.stderr)  # noqa: E731
    path = artifacts.build(base, args.threads, log=log)
    batch_step = (not args.no_batch_step and batched_artifact_unsupported_reason(base, 2) is None
                  and artifacts.one_token_unsupported_reason(base) is None)
    if batch_step:
        for graph in artifacts.BATCH_GRAPHS:
            artifacts.build(base, args.threads, log=log, graph=graph)
    code_only = artifacts.supplies_constants(base)  # one sequence at a time; batches compile in the call
    serves = ("one sequence at a time (code only: the process gives it its packed weights; batches compile in the "
              "call)" if code_only else f"batches of up to {artifacts.MAX_ROWS} rows"
              + (" (their steps of one and two tokens a row on the batch steps)" if batch_step else ""))
    print(f"{path} ready ({time.perf_counter() - start:.0f} s); generate(compile=True) with {args.threads} threads "
          f"loads it; it serves blocks of 1 to {artifacts.MAX_BLOCK} tokens, every context length and {serves}")
    if largest > artifacts.MAX_BLOCK:
        longer = "are compiled in each process" if code_only else \
            "run eagerly (compile='wait': with torch.compile in each process)"
        print(f"hf-bpd: the drafting shape asked for verifies blocks of {largest} tokens, over {artifacts.MAX_BLOCK}: "
              f"those steps {longer}; use at most {artifacts.MAX_BLOCK - 1} draft nodes", file=sys.stderr)
    return 0


REBUILDABLE = ("kernels", "toolchain", "inductor", "costs", "models", "gguf")  # cache folders hf_bpd makes again


def _clear_rebuildable() -> list[str]:
    """Remove the cache folders in `REBUILDABLE` (real folders inside the cache only); returns those removed."""
    import shutil

    from ..hub.locate import cache_dir

    removed = []
    for name in REBUILDABLE:
        folder = cache_dir() / name
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
            removed.append(str(folder))
    return removed


def _largest_block(model, args) -> int:
    """The largest block the checkpoint's defaults, or `--tree` / `--draft-nodes`, verify (1 for a plain base)."""
    if not hasattr(model, "heads"):
        return 1
    from ..generation.config import drafting_options
    from ..generation.decoding import plan_drafting

    options = {}
    if args.tree is not None:
        options.update(tree=args.tree, draft_nodes=None)
    if args.draft_nodes is not None:
        options.update(draft_nodes=args.draft_nodes, tree=None)
    plan = plan_drafting(model, drafting_options(options, None, model.generation_config))
    return plan.drafter.max_block_length()


def add_parsers(sub, command) -> None:
    """The `compile` subcommand's parser."""
    p = command(
        "compile", "build the compiled verification step for this machine once (loaded by every later process)",
        "Exports the base's verification step and compiles it ahead of time (AOTInductor) into "
        "$HF_BPD_CACHE/artifacts/: one artifact serves every block length up to 16 and every context length. "
        "Valid for this CPU, thread count, dtype, weights and torch version; generate(compile=True) loads it in "
        "seconds instead of compiling; batches' steps of one and of two tokens a row get graphs of their own beside it "
        "(the batch steps; --no-batch-step: built when a batch first needs them). A bf16 or int8-weight base on "
        "hf_bpd's kernels gets one of code only (a few MB; the process gives it its packed weights at load; no batch "
        "steps); so does a base of over 2 GiB of weights (an fp32 1.5B; given its own, unpacked, at load). --list "
        "shows the cache, --clear empties it.")
    p.add_argument("model", nargs="?", default=None, help="heads checkpoint directory or base model")
    p.add_argument("--threads", type=int, default=2, help="torch threads the artifact is built for (baked in)")
    _add_dtype(p, quantize=True)
    p.add_argument("--tree", default=None, help="a tree shape you will draft with (widths per head, e.g. 4,2,2,1): "
                   "says whether the artifact serves its blocks")
    p.add_argument("--draft-nodes", type=int, default=None, help="a draft-node budget you will draft with (the same)")
    p.add_argument("--no-batch-step", action="store_true",
                   help="build the step only, not the batch steps (a batch builds them in the background)")
    p.add_argument("--list", action="store_true", help="list the built artifacts")
    p.add_argument("--clear", action="store_true", help="remove every built artifact (none that a build holds)")
    p.add_argument("--all", action="store_true",
                   help="with --clear: also what else hf_bpd rebuilds on its own (kernels, the compiler wrapper, "
                        "inductor's cache, cost tables, converted and joined packaged bases); KenLM stays")
    p.set_defaults(func=cmd_compile)
