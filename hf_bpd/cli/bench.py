"""`hf-bpd bench` (decoding methods side by side), `hf-bpd analyze` (the paper's Section 6 analyses) and
`hf-bpd profile` (the cost model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..limits import MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, MAX_NUM_DRAFTS
from .common import (BENCH_DEFAULT_METHODS, DEVICE_HELP, RESCORER_NAMES, _add_common, _add_dtype,
                     _check_drafting_flags, _int_list, _locate, _positive, _questions, _setup, _writable_dir,
                     _writable_file, load_model)


def cmd_bench(args) -> int:
    _positive(args, "limit", "max_new_tokens", "threads", "pld_tokens", "early_exit_layer")
    _check_drafting_flags(args)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    _int_list(args.tree, "--tree")
    _locate(args.model)
    _locate(args.assistant_model, "assistant model")  # before anything heavy is loaded, as --model
    _questions(args)  # a bad prompt file fails before the model is loaded
    from ..evaluation import batch_bench, bench

    if args.batch_size is not None:
        if args.assistant_model is not None:
            raise ValueError("--assistant-model is for the method table (the assisted method), not --batch-size")
        sizes = _int_list(args.batch_size, "--batch-size", "1,4,16")
        if not sizes or min(sizes) < 1 or max(sizes) > 64:
            raise ValueError(f"--batch-size takes batch sizes from 1 to 64, got {args.batch_size!r}")
        questions = _questions(args)
        _writable_file(args.output)
        methods = [m.strip() for m in args.methods.split(",")] if args.methods else list(batch_bench.BATCH_METHODS)
        batch_bench.check_batch_methods(methods)  # before the model is loaded
        model, tokenizer = _setup(args)
        report = batch_bench.run_batch_bench(model, tokenizer, questions, sizes, args.max_new_tokens, args.chat,
                                             args.warmup, progress=not args.no_progress,
                                             log=lambda m: print(f"hf-bpd: {m}", file=sys.stderr), methods=methods,
                                             rounds=args.rounds)
        dtype = str(model.dtype).removeprefix("torch.")
        report = {"settings": {"model": args.model, "questions": args.questions, "limit": args.limit,
                               "max_new_tokens": args.max_new_tokens, "batch_sizes": sizes, "methods": methods,
                               "dtype": dtype, "warmup": args.warmup, "rounds": args.rounds,
                               "threads": args.threads},
                  "machine": bench.machine_info(), **report}
        print(batch_bench.markdown_batch_report(report), end="")
        if args.output:
            Path(args.output).write_text(json.dumps(report, indent=1))
            print(f"wrote {args.output}")
        return 0
    options = bench.BenchOptions(tree_widths=tuple(_int_list(args.tree, "--tree")), num_drafts=args.num_drafts,
                                 draft_top_k=args.draft_top_k, pld_tokens=args.pld_tokens,
                                 early_exit_layer=args.early_exit_layer, num_heads_to_use=args.num_heads_to_use,
                                 draft_nodes=args.draft_nodes, gguf=args.gguf, assistant=args.assistant_model,
                                 draft_gguf=args.draft_gguf)
    decoders = bench.default_decoders(options)
    # an assistant without --methods: the default methods and the assisted one
    default = bench.DEFAULT_METHODS + (("assisted",) if args.assistant_model else ())
    methods = bench.parse_methods(args.methods or ",".join(default), list(decoders))
    questions = _questions(args)
    _writable_file(args.output)
    _writable_dir(args.plot)
    model, tokenizer = _setup(args)
    report = bench.run_bench(model, tokenizer, questions, methods, decoders, max_new_tokens=args.max_new_tokens,
                             chat=args.chat, multi_turn=args.multi_turn, warmup=args.warmup,
                             progress=not args.no_progress, log=lambda m: print(f"hf-bpd: {m}", file=sys.stderr))
    chat = args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    report = {
        "settings": {"model": args.model, "questions": args.questions, "limit": args.limit,
                     "max_new_tokens": args.max_new_tokens, "requested_methods": methods, "chat": chat,
                     "multi_turn": args.multi_turn, "warmup": args.warmup, "seed": args.seed,
                     "dtype": str(model.dtype).removeprefix("torch."),
                     "quantize": args.quantize,
                     "tree": list(options.tree_widths), "num_drafts": options.num_drafts,
                     "draft_nodes": options.draft_nodes,
                     "draft_top_k": options.draft_top_k, "pld_tokens": options.pld_tokens,
                     "num_heads_to_use": options.num_heads_to_use,
                     "early_exit_layer": options.early_exit_layer, "assistant_model": options.assistant},
        "machine": bench.machine_info(),
        **report,
    }
    print(bench.markdown_report(report), end="")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")
    if args.plot:
        for path in bench.plot_report(report, args.plot):
            print(f"wrote {path}")
    return 0


def cmd_analyze(args) -> int:
    _positive(args, "limit", "max_new_tokens", "threads", "rescore_top_k")
    if args.rescore_top_k > MAX_DRAFT_TOP_K:
        raise ValueError(f"--rescore-top-k must be in [1, {MAX_DRAFT_TOP_K}], got {args.rescore_top_k} "
                         "(docs/reliability.md: Ceilings)")
    top_ks = _int_list(args.top_k, "--top-k", "1,2,4,8,16")
    _locate(args.model)
    questions = _questions(args)
    _writable_file(args.output)
    _writable_dir(args.plot)
    from ..evaluation import analysis, bench
    from ..rescorers.registry import available_rescorers, resolve_rescorer

    model, tokenizer = _setup(args)
    if not hasattr(model, "heads"):
        raise ValueError(f"{args.model} is a plain base model: analyze needs a heads checkpoint directory")
    bundled = getattr(model, "bundled_rescorers", {}) or {}
    name = args.rescorer
    if name is None:  # default: the first rescorer the checkpoint bundles, if any
        name = next((n for n in available_rescorers() if bundled.get(n) is not None), "none")
        if name == "none":
            print("hf-bpd: the checkpoint bundles no rescorer: rescored-draft analyses are left out", file=sys.stderr)
    rescorer = None if name == "none" else resolve_rescorer(name, bundled, model)
    if rescorer is not None:
        rescorer.check_compatible(model)
        rescorer.check_work(model.config.num_heads, min(args.rescore_top_k, model.config.draft_size), 1)
    if max(top_ks) > model.config.draft_size:
        raise ValueError(f"--top-k values must be <= {model.config.draft_size} (the draft vocabulary)")
    records = analysis.run_analysis(model, tokenizer, questions, args.max_new_tokens, top_ks, rescorer,
                                    min(args.rescore_top_k, model.config.draft_size), chat=args.chat,
                                    progress=not args.no_progress)
    summary = analysis.summarize_by_category(records)
    print(analysis.markdown_tables(summary, None if rescorer is None else name), end="")
    if args.output:
        chat = args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
        report = {
            "settings": {"model": args.model, "questions": args.questions, "limit": args.limit,
                         "max_new_tokens": args.max_new_tokens, "top_k": top_ks,
                         "rescorer": None if rescorer is None else name, "rescore_top_k": args.rescore_top_k,
                         "chat": chat, "num_heads": model.config.num_heads},
            "machine": bench.machine_info(),
            "summary": summary,
            "prompts": [r.as_dict() for r in records],
        }
        Path(args.output).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")
    if args.plot:
        for path in analysis.plot_analysis(records, summary, args.plot):
            print(f"wrote {path}")
    return 0


def cmd_profile(args) -> int:
    from ..runtime import cost

    _positive(args, "threads", "past")
    lengths = _block_lengths(args.lengths)
    _writable_file(args.output)
    _locate(args.model)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.dtype, args.device)
    base = getattr(model, "base_lm", model).eval()
    costs = cost.measure_costs(base, lengths, compiled=not args.no_compile, past=args.past)
    print(cost.cost_table(costs), end="")
    print(f"stored {cost.save_costs(base, costs)}")
    if args.output:
        Path(args.output).write_text(json.dumps(costs, indent=1))
        print(f"wrote {args.output}")
    return 0


def _block_lengths(text: str) -> list[int]:
    """`--lengths`: a range `1-16` or a list `1,2,4,8` of block lengths in [1, 256]."""
    bad = ValueError(f"--lengths must be block lengths in [1, 256]: a range such as 1-16 or a list such as 1,2,4,8, "
                     f"got {text[:60]!r}")
    if "-" in text:
        low, _, high = text.partition("-")
        if not (low.strip().isdigit() and high.strip().isdigit() and len(low) < 6 and len(high) < 6):
            raise bad
        lengths = list(range(int(low), int(high) + 1))
    else:
        try:
            lengths = _int_list(text, "--lengths", "1,2,4,8")
        except ValueError:
            raise bad from None
    if not lengths or min(lengths) < 1 or max(lengths) > 256:
        raise bad
    return lengths


def add_parsers(sub, command) -> None:
    """The `bench`, `analyze` and `profile` subcommands' parsers."""
    bench = command(
        "bench", "decoding methods side by side on a prompt file (speed, block efficiency, exactness)",
        "Runs decoding methods on every prompt, alternating their order per prompt, against plain "
        "greedy decoding (ar) in the same run, and prints a Markdown table per method (and per "
        "category): tokens/s, speed-up vs ar, block efficiency (tokens per serial call), mean "
        "accepted draft tokens, draft time share, and whether every output is token-identical to ar "
        "(to ar-compiled, the same dtype's compiled plain decoding, for bf16/fp16 and int8 weights). "
        "Methods that do not apply (no heads, no bundled rescorer, architecture refused by "
        "transformers) are listed as skipped. --output writes every per-prompt figure as JSON.")
    _add_common(bench)
    bench.add_argument("--methods", default=None,
                       help="comma-separated methods: ar, llama.cpp, llama.cpp-specK (K: 1, 2, 3, 4, 6, 8, 12 or 16 "
                            "draft tokens), pld, early-exit, assisted (needs "
                            "--assistant-model), default, default-fixed, default-switch, pbest, pbest-ngram, tree, "
                            "tree+ngram, pbest-ngram+lookup[-nodes][-compiled], ar-compiled, and "
                            "bpd[+RESCORER][+lookup][-compiled][-cost|-switch] (ar always runs) "
                            f"(default: {','.join(BENCH_DEFAULT_METHODS)}); with --batch-size: "
                            "ar, ar-compiled, ar-artifact, bpd, bpd-compiled (default: all five)")
    bench.add_argument("--multi-turn", action="store_true",
                       help="run every MT-bench turn as a conversation (earlier answers: ar's), not only turn 1")
    bench.add_argument("--tree", default="4,2,2,1", metavar="WIDTHS",
                       help="sparse tree widths per head for tree / tree+ngram (cut to the model's heads)")
    bench.add_argument("--num-drafts", type=int, default=4, help=f"p for the p-best methods, 1-{MAX_NUM_DRAFTS}")
    bench.add_argument("--draft-nodes", type=int, default=15, metavar="N",
                       help=f"draft nodes per step for the pbest-ngram+lookup-nodes methods, 1-{MAX_DRAFT_NODES}")
    bench.add_argument("--num-heads-to-use", type=int, default=None,
                       help="chain methods (bpd...) draft with the first N heads (default: the checkpoint's)")
    bench.add_argument("--draft-top-k", type=int, default=None,
                       help=f"lattice width k for rescoring and p-best, 1-{MAX_DRAFT_TOP_K} (default: the "
                            "checkpoint's, else 16)")
    bench.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for pld")
    bench.add_argument("--early-exit-layer", type=int, default=None,
                       help="assistant_early_exit for early-exit (default: half the base's layers)")
    bench.add_argument("--gguf", default=None, metavar="FILE.gguf",
                       help="the GGUF llama.cpp decodes for the llama.cpp method (default: the packaged base's; the "
                            "method needs the optional llama-cpp-python, else it is skipped)")
    bench.add_argument("--draft-gguf", default=None, metavar="FILE.gguf",
                       help="the draft model llama.cpp-specK drafts with (default: the packaged GGUF of "
                            "--assistant-model, so both speculative methods draft with the same model)")
    bench.add_argument("--assistant-model", default=None, metavar="NAME",
                       help="the draft model of the assisted method (transformers' assisted generation, "
                            "generate(assistant_model=...), greedy): a local directory, packaged alias or Hub id of a "
                            "small model with the base's tokenizer, e.g. qwen2.5-coder-0.5b-instruct for a "
                            "Qwen2.5-Coder base; loaded once, in the base's dtype; adds assisted to the default "
                            "methods (default: none, and assisted is skipped with a note)")
    bench.add_argument("--warmup", type=int, default=1, help="uncounted warm-up generations per method")
    bench.add_argument("--rounds", type=int, default=1,
                       help="with --batch-size: timed passes over the batches, the methods' order rotating from call "
                            "to call (more rounds, less of the machine's drift in the ratios)")
    bench.add_argument("--batch-size", default=None, metavar="N[,N...]",
                       help="instead of the method table: batched BPD (the checkpoint's drafting, eager) against "
                            "transformers' batched plain greedy generate() on the same left-padded batches, per batch "
                            "size, e.g. 1,4,16 (each 1-64) (default: off)")
    bench.set_defaults(func=cmd_bench)

    analyze = command(
        "analyze", "the paper's Section 6 analyses of block drafts (repetition, entropy, oracle top-k)",
        "Decodes each prompt greedily with the base, then evaluates every decoding step of that "
        "reference: consecutive repetition in vanilla and rescored block drafts (Table 3), per-head "
        "entropy and h_max (Fig. 3), oracle top-k block efficiency as a function of k (Fig. 6), and "
        "wins/ties/losses of rescored vs vanilla drafts with % repair/regress (Table 5).")
    _add_common(analyze, model_default=None)
    analyze.add_argument("--top-k", default="1,2,4,8,16", metavar="K1,K2,...",
                         help="lattice widths k for the oracle curve")
    analyze.add_argument("--rescorer", choices=[*RESCORER_NAMES, "none"], default=None,
                         help="bundled rescorer for rescored drafts (default: the first the checkpoint bundles)")
    analyze.add_argument("--rescore-top-k", type=int, default=16,
                         help=f"lattice width the rescorer sees, 1-{MAX_DRAFT_TOP_K}")
    analyze.set_defaults(func=cmd_analyze)

    prof = command(
        "profile", "the cost model: forward cost of 1..16 tokens, eager and compiled, vs the bandwidth bound",
        "Times one base forward of n new tokens on a KV cache (eager, and through generate(compile=True)'s "
        "compiled step: the first call per length compiles, ~1-2 min each for SmolLM2 on a CPU), next to "
        "the bound weight bytes / measured memory bandwidth; prints the table and stores it under "
        "$HF_BPD_CACHE/costs/.")
    prof.add_argument("--model", default="smollm2-135m-instruct", help="heads checkpoint directory or base model")
    prof.add_argument("--lengths", default="1-16", help="block lengths in [1, 256]: a range 1-16 or a list 1,2,4,8")
    prof.add_argument("--past", type=int, default=200, help="tokens already in the KV cache")
    prof.add_argument("--no-compile", action="store_true", help="eager only (no compilation)")
    prof.add_argument("--threads", type=int, default=2, help="torch threads")
    prof.add_argument("--seed", type=int, default=0, help="random seed")
    _add_dtype(prof)
    prof.add_argument("--device", default="cpu", help=DEVICE_HELP)
    prof.add_argument("--output", metavar="FILE.json", help="also write the table as JSON (default: none)")
    prof.set_defaults(func=cmd_profile)
