"""`hf-bpd generate`: one prompt, printed with its generation statistics; `--compare` adds plain greedy decoding
(and plain BPD) side by side."""

from __future__ import annotations

import argparse
import math
import sys
import time

from ..limits import MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, MAX_NUM_DRAFTS
from .common import (DEFAULT_PROMPT, DEVICE_HELP, RESCORER_NAMES, _add_dtype, _check_drafting_flags, _int_list, _locate,
                     _positive, load_for_generation)


def _encode(tokenizer, prompt: str, chat: bool):
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("this tokenizer has no chat template: drop --chat")
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def _draft_options(args) -> dict:
    """`generate()` keyword arguments for the drafting options of `hf-bpd generate` (unset: the checkpoint's)."""
    options = {}
    if args.rescorer is not None:
        options["rescorer"] = args.rescorer
    for name in ("num_drafts", "draft_top_k", "num_heads_to_use", "draft_schedule", "prompt_lookup", "draft_nodes",
                 "heads_int8", "drafter", "draft_depth"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.tree:
        options["tree"] = ",".join(map(str, _int_list(args.tree, "--tree")))
    return options


def _method_label(model, options: dict) -> str:
    config = model.generation_config
    compiled = ", compiled" if options.get("compile", config.compile) else ""
    if options.get("drafter", getattr(config, "drafter", "heads")) == "feature":
        lookup = " + lookup" if options.get("prompt_lookup", config.prompt_lookup) else ""
        return f"feature-level drafter, chain of {options.get('draft_depth') or 4}{lookup}{compiled}"
    rescorer = options.get("rescorer", config.rescorer)
    name = f" + {rescorer}" if isinstance(rescorer, str) and rescorer != "none" else ""  # else head scores
    name += " + lookup" if options.get("prompt_lookup", config.prompt_lookup) else ""
    schedule = options.get("draft_schedule", config.draft_schedule)
    compiled += f", {schedule} schedule" if schedule in ("cost", "switch") else ""
    if options.get("tree", config.tree) is not None:
        return f"tree{name}{compiled}"
    drafts = options.get("num_drafts") or config.num_drafts
    nodes = options.get("draft_nodes", getattr(config, "draft_nodes", None))
    compiled = (f", {nodes} nodes" if nodes is not None else "") + compiled
    return f"bpd{name}" + (f", {drafts}-best" if drafts > 1 else "") + compiled


def _timed(fn, repeats: int = 1):
    """`(output of the first run, the fastest run's seconds)` over `repeats` runs (the fastest: what the machine
    can do, with the other core's hiccups and page faults left out, for every method alike)."""
    start = time.perf_counter()
    out = fn()
    best = time.perf_counter() - start
    for _ in range(repeats - 1):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def _check_sampling(args) -> None:
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be a number > 0, got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: no top-k filtering), got {args.top_k}")
    if not args.do_sample and (args.temperature != 1.0 or args.top_p != 1.0 or args.top_k != 0):
        raise ValueError("--temperature / --top-p / --top-k only apply to sampling: add --do-sample, or drop them")


def cmd_generate(args) -> int:
    _positive(args, "max_new_tokens", "threads")
    _check_sampling(args)
    _check_drafting_flags(args)
    if args.tree:
        _int_list(args.tree, "--tree")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty: pass the text to continue")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (timed runs per method with --compare), got {args.repeats}")
    if args.no_heads and (args.rescorer or args.tree or args.num_drafts or args.draft_top_k or args.num_heads_to_use
                          or args.prompt_lookup is not None or args.draft_schedule or args.draft_nodes
                          or args.drafter or args.draft_depth):
        raise ValueError("--no-heads decodes plainly, so drafting flags (--rescorer, --num-drafts, --draft-top-k, "
                         "--tree, --num-heads-to-use, --prompt-lookup, --draft-schedule, --draft-nodes) would be ignored: drop them")
    _locate(args.model)
    import torch
    from transformers import TextStreamer

    from ..runtime.ordered_attention import uses_ordered_attention

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_for_generation(args.model, args.dtype, args.device, args.quantize)
    has_heads = hasattr(model, "heads")
    options = _draft_options(args) if has_heads else {}
    if not has_heads and (args.rescorer or args.tree or args.num_drafts or args.draft_top_k or args.num_heads_to_use
                          or args.prompt_lookup is not None or args.draft_schedule or args.draft_nodes):
        raise ValueError(f"{args.model} is a plain base model: drafting options need a heads checkpoint")
    inputs = _encode(tokenizer, args.prompt, args.chat).to(model.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    if args.do_sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.no_heads:  # plain decoding; a plain base model decodes plainly anyway
        options = {"use_heads": False} if has_heads else {}
    if args.compile is not None:
        if not has_heads:
            raise ValueError(f"{args.model} is a plain base model: --compile needs a heads checkpoint")
        options["compile"] = args.compile
    if args.tie_margin is not None:
        if not has_heads:
            raise ValueError(f"{args.model} is a plain base model: --tie-margin needs a heads checkpoint")
        options["tie_margin"] = args.tie_margin
    # compiled verification: asked for, or the checkpoint's default (its generation_config.json)
    compiled = has_heads and options.get("compile", getattr(model.generation_config, "compile", False))
    if has_heads and not args.no_heads:
        from ..generation.config import drafting_options
        from ..generation.decoding import plan_drafting

        # bad drafting options fail here, in one line, before any decoding
        plan_drafting(model, drafting_options(dict(options), None, model.generation_config))
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    prompt_length = inputs["input_ids"].shape[1]
    # the comparison's plain BPD row: the heads' argmax chain, same heads and compilation as this run
    plain_bpd = dict(rescorer=None, num_drafts=1, tree=None, prompt_lookup=False, draft_nodes=None, draft_schedule="fixed",
                     compile="wait" if compiled else False, **{k: v for k, v in options.items() if k in ("num_heads_to_use", "tie_margin")})
    same_ties = {k: v for k, v in options.items() if k == "tie_margin"}  # compiled plain decides near-ties alike
    if args.compare or compiled:  # warm-up (allocations, rescorer loading, loading the compiled step) is not timed
        model.generate(**inputs, **{**kwargs, "max_new_tokens": 8}, **options)

    out, seconds = _timed(lambda: model.generate(**inputs, streamer=streamer, **kwargs, **options))
    if args.compare and args.repeats > 1:  # the same call again, unprinted: its fastest run is compared
        seconds = min(seconds, _timed(lambda: model.generate(**inputs, **kwargs, **options), args.repeats - 1)[1])
    stats = getattr(model, "last_generation_stats", None) if has_heads and not args.no_heads else None
    new_tokens = out.shape[1] - prompt_length
    if not args.stream:
        print(tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True))
    print("---")
    print(f"new tokens: {new_tokens}  time: {seconds:.2f} s  speed: {new_tokens / seconds:.1f} tok/s" +
          (f"  verification: {model.last_generation_stats.verifier}" if compiled else ""))
    if compiled and args.compare:  # the comparison runs every compiled row compiled: wait for the step if need be
        start = time.perf_counter()
        waiting = {**options, "compile": "wait"}
        model.generate(**inputs, **{**kwargs, "max_new_tokens": 8}, **waiting)
        if not args.no_heads:
            model.generate(**inputs, **{**kwargs, "max_new_tokens": 8}, use_heads=False, compile="wait", **same_ties)
            model.generate(**inputs, **{**kwargs, "max_new_tokens": 8}, **{**plain_bpd, "compile": "wait"})
        if time.perf_counter() - start > 5:
            import torch as _torch

            print(f"compiled verification ready after {time.perf_counter() - start:.0f} s (CPU: "
                  f"{_torch.backends.cpu.get_cpu_capability()})", file=sys.stderr)
        if stats is not None and stats.verifier == "eager":  # this run did not wait for it: time it again, compiled
            out, seconds = _timed(lambda: model.generate(**inputs, **kwargs, **waiting), args.repeats)
            stats, new_tokens = model.last_generation_stats, out.shape[1] - prompt_length
    if stats is not None:
        print(f"block efficiency: {stats.block_efficiency:.2f} tokens per serial call "
              f"({stats.serial_calls} calls, mean accepted draft tokens {stats.mean_accepted:.2f})")
        if stats.tie_checks:
            print(f"near-ties decided by the base's eager generate(): {stats.tie_checks} ({stats.tie_changes} "
                  f"changed, {stats.tie_seconds:.2f} s)")
    if args.compare:
        base = getattr(model, "base_lm", model)
        ref, ref_seconds = _timed(lambda: base.generate(**inputs, **kwargs), args.repeats)  # same settings
        rows = [("plain greedy generate()" if not args.do_sample else "plain sampling generate()",
                 ref.shape[1] - prompt_length, ref_seconds, 1.0, None)]
        label = _method_label(model, options) if stats is not None else "this run"
        target, target_name = ref, "plain"
        if compiled and not args.no_heads:
            plain_c, plain_c_seconds = _timed(lambda: model.generate(**inputs, **kwargs, use_heads=False,
                                                                       compile="wait", **same_ties), args.repeats)
            rows.append(("plain decoding, compiled (use_heads=False, compile=True)", plain_c.shape[1] - prompt_length,
                         plain_c_seconds, 1.0,
                         None if args.do_sample or uses_ordered_attention(base) else torch.equal(plain_c, ref)))
            if uses_ordered_attention(base):  # half precision: exact against its own compiled plain decoding
                target, target_name = plain_c, "compiled plain"
        if stats is not None and _method_label(model, options) not in ("bpd", "bpd, compiled"):
            plain, plain_seconds = _timed(lambda: model.generate(**inputs, **kwargs, **plain_bpd), args.repeats)
            rows.append(("bpd (heads' top-1 draft" + (", compiled)" if compiled else ")"), plain.shape[1] - prompt_length, plain_seconds,
                         model.last_generation_stats.block_efficiency,
                         None if args.do_sample else torch.equal(plain, target)))
        rows.append((f"{label} (above)", new_tokens, seconds, stats.block_efficiency if stats else 1.0,
                     None if args.do_sample else torch.equal(out, target)))
        print(f"\n| method | tok/s | speed-up | block efficiency | identical to {target_name} |")
        print("| --- | --- | --- | --- | --- |")
        ref_rate = rows[0][1] / rows[0][2]
        for name, n, secs, be, same in rows:
            ident = "-" if same is None else ("yes" if same else "NO")
            print(f"| {name} | {n / secs:.1f} | {n / secs / ref_rate:.2f}x | {be:.2f} | {ident} |")
        if not args.do_sample:
            print(f"speed-up: {ref_seconds / seconds:.2f}x  identical output: {torch.equal(out, target)}"
                  + ("" if target is ref else " (to compiled plain decoding: in half precision eager generate() "
                                              "rounds differently)"))
    return 0


def add_parsers(sub, command) -> None:
    """The `generate` subcommand's parser."""
    gen = command(
        "generate", "generate text for one prompt and print generation statistics",
        "Generates a continuation of --prompt with the checkpoint's heads (token-identical to the base's greedy "
        "output) and prints it with the block efficiency; --compare adds a side-by-side table of plain greedy "
        "generate(), plain BPD and this run with speed-ups and exactness checks. Drafting flags left out use the "
        "checkpoint's generation_config.json.")
    gen.add_argument("--model", default="smollm2-135m-instruct",
                     help="heads checkpoint directory, or a base model (local dir, Hub id, packaged alias)")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text to continue")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128,
                     help="tokens to generate (prompt + this must fit the base's positions)")
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding (lossless)")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0; with --do-sample)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (with --do-sample)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens, 0: all (with "
                                                          "--do-sample)")
    gen.add_argument("--seed", type=int, default=0, help="random seed")
    gen.add_argument("--threads", type=int, default=2, help="torch threads")
    _add_dtype(gen, quantize=True)
    gen.add_argument("--device", default="cpu", help=DEVICE_HELP)
    gen.add_argument("--no-heads", action="store_true", help="plain decoding with the base model")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    gen.add_argument("--rescorer", choices=["none", *RESCORER_NAMES], default=None,
                     help="draft refinement: a rescorer bundled with the checkpoint, or none (the heads' scores) "
                          "(default: the checkpoint's)")
    gen.add_argument("--num-drafts", type=int, default=None,
                     help=f"p: drafts verified together per step, 1-{MAX_NUM_DRAFTS} (default: the checkpoint's)")
    gen.add_argument("--draft-top-k", type=int, default=None,
                     help=f"lattice width k (tokens per head), 1-{MAX_DRAFT_TOP_K} (default: the checkpoint's, else 1 "
                          "for plain BPD and 16 when rescoring)")
    gen.add_argument("--tree", default=None, metavar="WIDTHS",
                     help="Medusa-style sparse tree, top-k widths per head, e.g. 4,2,2,1 (default: none)")
    gen.add_argument("--num-heads-to-use", type=int, default=None,
                     help="draft with only the first N heads (default: the checkpoint's)")
    gen.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=None,
                     help="also draft prompt lookup's copy of the context and verify it with the heads' drafts "
                          "(default: the checkpoint's)")
    gen.add_argument("--draft-schedule", choices=["fixed", "cost", "switch"], default=None,
                     help="fixed: verify every drafted token; cost: only those expected to pay for their verification "
                          "(calibrated head confidences x this machine's forward costs); switch: plain one-token "
                          "steps while drafting does not pay in the call (default: the checkpoint's)")
    gen.add_argument("--draft-nodes", type=int, default=None, metavar="N",
                     help=f"verify N draft tokens per step, 1-{MAX_DRAFT_NODES}: the p-best paths and prompt lookup's "
                          "copy compete for them, likeliest first (default: the checkpoint's)")
    gen.add_argument("--drafter", choices=["heads", "feature"], default=None,
                     help="what drafts: the heads, or the checkpoint's feature-level drafter (default: heads)")
    gen.add_argument("--draft-depth", type=int, default=None, metavar="N",
                     help="with --drafter feature: its chain length, 1-32 (default: 4)")
    gen.add_argument("--heads-int8", action=argparse.BooleanOptionalAction, default=None,
                     help="the heads step with int8 weights in a C++ kernel on CPU (a quarter of the bytes per step; "
                          "only the drafts can change); --no-heads-int8: the heads' own fp32 weights (default: on "
                          "with compiled verification on a CPU)")
    gen.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="verify with a torch.compile'd step on a static cache (first use compiles, ~1-2 min for "
                          "SmolLM2 on a CPU; --compare then also times compiled plain decoding); --no-compile: eager "
                          "(default: the checkpoint's)")
    gen.add_argument("--tie-margin", type=float, default=None, metavar="M",
                     help="greedy: tokens whose two best scores are closer than M x max(1, |best|) are decided by the "
                          "base's own eager generate() (0: never; default: the checkpoint's, else 5e-5 for fp32)")
    gen.add_argument("--compare", action="store_true",
                     help="also run the base's plain generate() (and plain BPD) and print a side-by-side table")
    gen.add_argument("--repeats", type=int, default=3, metavar="N",
                     help="with --compare: time every method N times and compare the fastest runs (default: 3)")
    gen.set_defaults(func=cmd_generate)
