"""`hf-bpd`: the command line. Errors in user input print one line (`hf-bpd: error: ...`) and exit 2; `--debug`
(or `HF_BPD_DEBUG=1`) shows the traceback instead.

Subcommands: `generate` (one prompt, with statistics), `bench` (decoding methods side by side on a prompt file,
`hf_bpd.evaluation.bench`), `analyze` (the paper's Section 6 analyses of block drafts, `hf_bpd.evaluation.analysis`),
`build-ngram`, `tune-alpha`, `calibrate`, `profile`, `export` (heads to vLLM's Medusa format), `train`.

Start-up imports nothing heavy: the parser, `--help` and the checks of flags, files and model names run before
torch and transformers are imported (measured: `hf-bpd generate --help` 4.9 s -> 0.2 s), and every flag is checked
before a model is loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from .limits import MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, MAX_NUM_DRAFTS

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
DEFAULT_QUESTIONS = "benchmarks/dev_prompts.jsonl"
# Built-in rescorer names and bench's default methods, written out so that the parser needs no import of torch
# (tests keep them equal to `hf_bpd.available_rescorers()` and `hf_bpd.evaluation.bench.DEFAULT_METHODS`).
RESCORER_NAMES = ("neural", "ngram")
BENCH_DEFAULT_METHODS = ("ar", "pld", "early-exit", "bpd", "bpd+ngram", "bpd+neural", "pbest", "pbest-ngram", "tree",
                         "tree+ngram", "default")
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_HELP = "where the model runs: cpu, cuda, cuda:N, mps, or auto (transformers' device_map='auto')"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`hf-bpd: error: ...`, exit 2) instead of usage + error."""

    def error(self, message):
        sys.stderr.write(f"hf-bpd: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


class _Formatter(argparse.HelpFormatter):
    """Help with every flag's default: "(default: X)" unless the help text already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings \
                or isinstance(action, argparse._HelpAction):
            return text
        default = "off" if action.default is False else "on" if action.default is True else "%(default)s"
        return f"{text} (default: {default})"


class _RawFormatter(_Formatter, argparse.RawDescriptionHelpFormatter):
    """`_Formatter` that keeps the description's line breaks (train_heads' docstring)."""


def _debug_flag(parser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error instead of one line (also: HF_BPD_DEBUG=1)")


def _check_device(device: str) -> None:
    """`--device`: its form before any import, then (after torch is imported) that this machine has it."""
    import re

    if not re.fullmatch(r"cpu|auto|mps|(cuda|xpu)(:\d{1,2})?", device):
        raise ValueError(f"--device must be cpu, cuda, cuda:N, mps or auto, got {device[:40]!r}")
    if "torch" not in sys.modules:
        return
    import torch

    kind = device.partition(":")[0]
    available = {"cpu": True, "auto": True, "cuda": torch.cuda.is_available(),
                 "mps": torch.backends.mps.is_available(), "xpu": hasattr(torch, "xpu") and torch.xpu.is_available()}
    if not available[kind]:
        raise ValueError(f"--device {device}: torch {torch.__version__} sees no {kind} device here: use --device cpu")
    if kind in ("cuda", "xpu") and ":" in device and int(device.partition(":")[2]) >= getattr(torch, kind).device_count():
        raise ValueError(f"--device {device}: only {getattr(torch, kind).device_count()} {kind} device(s) here")


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu"):
    """A heads checkpoint directory (with its base) or a plain base model, in `dtype` on `device` (`"auto"`:
    transformers' `device_map="auto"`)."""
    import torch

    from .hub.base_models import load_base_model
    from .modeling import BlockwiseParallelForCausalLM

    _check_device(device)
    options = {"dtype": getattr(torch, dtype)}
    if device != "cpu":
        options["device_map"] = device
    if _is_heads_checkpoint(name_or_path):
        return BlockwiseParallelForCausalLM.from_pretrained(name_or_path, **options)
    return load_base_model(name_or_path, **options)


def load_for_generation(name_or_path: str, dtype: str = "float32", device: str = "cpu"):
    """`(model, tokenizer)`: `load_model` and the tokenizer (a checkpoint's is its base's)."""
    from .hub.base_models import load_tokenizer

    return load_model(name_or_path, dtype, device), load_tokenizer(name_or_path)


def _is_heads_checkpoint(name_or_path: str) -> bool:
    """Whether `name_or_path` is a local directory whose config.json is a heads checkpoint's."""
    config_file = Path(name_or_path) / "config.json"
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, OSError) as err:
        raise ValueError(f"{config_file} is not valid JSON ({_one_line(err)}): restore it") from None
    return isinstance(config, dict) and config.get("model_type") == "blockwise_parallel"


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
                 "heads_int8"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.tree:
        options["tree"] = ",".join(map(str, _int_list(args.tree, "--tree")))
    return options


def _method_label(model, options: dict) -> str:
    config = model.generation_config
    compiled = ", compiled" if options.get("compile", config.compile) else ""
    rescorer = options.get("rescorer", config.rescorer)
    name = f" + {rescorer}" if isinstance(rescorer, str) and rescorer != "none" else ""  # else head scores
    name += " + lookup" if options.get("prompt_lookup", config.prompt_lookup) else ""
    compiled += ", cost schedule" if options.get("draft_schedule", config.draft_schedule) == "cost" else ""
    if options.get("tree", config.tree) is not None:
        return f"tree{name}{compiled}"
    drafts = options.get("num_drafts") or config.num_drafts
    nodes = options.get("draft_nodes", getattr(config, "draft_nodes", None))
    compiled = (f", {nodes} nodes" if nodes is not None else "") + compiled
    return f"bpd{name}" + (f", {drafts}-best" if drafts > 1 else "") + compiled


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _check_sampling(args) -> None:
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be a number > 0, got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: no top-k filtering), got {args.top_k}")
    if not args.do_sample and (args.temperature != 1.0 or args.top_p != 1.0 or args.top_k != 0):
        raise ValueError("--temperature / --top-p / --top-k only apply to sampling: add --do-sample, or drop them")


def _check_drafting_flags(args) -> None:
    """Ranges of the drafting flags (the ones that depend on the checkpoint are checked once it is loaded)."""
    _positive(args, "num_drafts", "draft_top_k", "num_heads_to_use", "draft_nodes")
    for name, high in (("draft_top_k", MAX_DRAFT_TOP_K), ("num_drafts", MAX_NUM_DRAFTS),
                       ("draft_nodes", MAX_DRAFT_NODES)):
        value = getattr(args, name, None)
        if value is not None and value > high:
            raise ValueError(f"--{name.replace('_', '-')}: {name} must be an integer in [1, {high}], got {value} "
                             "(README: Errors and limits)")


def _locate(name: str | None) -> None:
    """Fail in one line, before torch is imported, when `--model` cannot be found (`hf_bpd.hub.locate`)."""
    if name is not None:
        from .hub.locate import locate

        locate(name, "model")


def cmd_generate(args) -> int:
    _positive(args, "max_new_tokens", "threads")
    _check_sampling(args)
    _check_drafting_flags(args)
    if args.tree:
        _int_list(args.tree, "--tree")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty: pass the text to continue")
    if args.no_heads and (args.rescorer or args.tree or args.num_drafts or args.draft_top_k or args.num_heads_to_use
                          or args.prompt_lookup is not None or args.draft_schedule or args.draft_nodes):
        raise ValueError("--no-heads decodes plainly, so drafting flags (--rescorer, --num-drafts, --draft-top-k, "
                         "--tree, --num-heads-to-use, --prompt-lookup, --draft-schedule, --draft-nodes) would be ignored: drop them")
    _locate(args.model)
    import torch
    from transformers import TextStreamer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_for_generation(args.model, args.dtype, args.device)
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
        from .generation.config import drafting_options
        from .generation.decoding import plan_drafting

        # bad drafting options fail here, in one line, before any decoding
        plan_drafting(model, drafting_options(dict(options), None, model.generation_config))
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    prompt_length = inputs["input_ids"].shape[1]
    # the comparison's plain BPD row: the heads' argmax chain, same heads and compilation as this run
    plain_bpd = dict(rescorer=None, num_drafts=1, tree=None, prompt_lookup=False, draft_nodes=None, draft_schedule="fixed",
                     compile=compiled, **{k: v for k, v in options.items() if k in ("num_heads_to_use", "tie_margin")})
    same_ties = {k: v for k, v in options.items() if k == "tie_margin"}  # compiled plain decides near-ties alike
    if args.compare or compiled:  # warm-up (allocations, rescorer loading, compilation) is not timed
        start = time.perf_counter()
        model.generate(**inputs, **{**kwargs, "max_new_tokens": 8}, **options)
        if compiled and args.compare and not args.no_heads:
            model.generate(**inputs, **{**kwargs, "max_new_tokens": 8}, use_heads=False, compile=True,
                           **same_ties)
            model.generate(**inputs, **{**kwargs, "max_new_tokens": 8}, **plain_bpd)
        if compiled:
            import torch as _torch

            print(f"compiled the verification step(s) in {time.perf_counter() - start:.0f} s (once per process; "
                  f"CPU: {_torch.backends.cpu.get_cpu_capability()})", file=sys.stderr)

    out, seconds = _timed(lambda: model.generate(**inputs, streamer=streamer, **kwargs, **options))
    stats = getattr(model, "last_generation_stats", None) if has_heads and not args.no_heads else None
    new_tokens = out.shape[1] - prompt_length
    if not args.stream:
        print(tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True))
    print("---")
    print(f"new tokens: {new_tokens}  time: {seconds:.2f} s  speed: {new_tokens / seconds:.1f} tok/s")
    if stats is not None:
        print(f"block efficiency: {stats.block_efficiency:.2f} tokens per serial call "
              f"({stats.serial_calls} calls, mean accepted draft tokens {stats.mean_accepted:.2f})")
        if stats.tie_checks:
            print(f"near-ties decided by the base's eager generate(): {stats.tie_checks} ({stats.tie_changes} "
                  f"changed, {stats.tie_seconds:.2f} s)")
    if args.compare:
        base = getattr(model, "base_lm", model)
        ref, ref_seconds = _timed(lambda: base.generate(**inputs, **kwargs))  # the same greedy/sampling settings
        rows = [("plain greedy generate()" if not args.do_sample else "plain sampling generate()",
                 ref.shape[1] - prompt_length, ref_seconds, 1.0, None)]
        label = _method_label(model, options) if stats is not None else "this run"
        if compiled and not args.no_heads:
            plain_c, plain_c_seconds = _timed(lambda: model.generate(**inputs, **kwargs, use_heads=False, compile=True,
                                                                       **same_ties))
            rows.append(("plain decoding, compiled (use_heads=False, compile=True)", plain_c.shape[1] - prompt_length,
                         plain_c_seconds, 1.0, None if args.do_sample else torch.equal(plain_c, ref)))
        if stats is not None and _method_label(model, options) not in ("bpd", "bpd, compiled"):
            plain, plain_seconds = _timed(lambda: model.generate(**inputs, **kwargs, **plain_bpd))
            rows.append(("bpd (heads' top-1 draft" + (", compiled)" if compiled else ")"), plain.shape[1] - prompt_length, plain_seconds,
                         model.last_generation_stats.block_efficiency,
                         None if args.do_sample else torch.equal(plain, ref)))
        rows.append((f"{label} (above)", new_tokens, seconds, stats.block_efficiency if stats else 1.0,
                     None if args.do_sample else torch.equal(out, ref)))
        print("\n| method | tok/s | speed-up | block efficiency | identical to plain |")
        print("| --- | --- | --- | --- | --- |")
        ref_rate = rows[0][1] / rows[0][2]
        for name, n, secs, be, same in rows:
            ident = "-" if same is None else ("yes" if same else "NO")
            print(f"| {name} | {n / secs:.1f} | {n / secs / ref_rate:.2f}x | {be:.2f} | {ident} |")
        if not args.do_sample:
            print(f"speed-up: {ref_seconds / seconds:.2f}x  identical output: {torch.equal(out, ref)}")
    return 0


def _int_list(text: str, what: str, example: str = "4,2,2,1") -> list[int]:
    parts = [v for v in text.replace(" ", "").split(",") if v]
    if len(parts) > 256 or not all(v.isdigit() and len(v) <= 6 for v in parts):
        raise ValueError(f"{what} must be comma-separated integers such as {example}, got {text[:60]!r}")
    values = [int(v) for v in parts]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} must be comma-separated integers >= 1, got {text!r}")
    return values


def _positive(args, *names) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _writable_file(path: str | None) -> None:
    if path:
        target = Path(path)
        if target.is_dir():
            raise ValueError(f"--output {path} is a directory: pass a file name such as results.json")
        target.parent.mkdir(parents=True, exist_ok=True)


def _writable_dir(path: str | None) -> None:
    if path:
        if Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"--plot {path} is a file: pass a directory for the PNG plots")
        Path(path).mkdir(parents=True, exist_ok=True)


def _questions(args) -> list[dict]:
    from .evaluation.bench import load_questions

    questions = load_questions(args.questions)
    return questions[: args.limit] if args.limit else questions


def _setup(args):
    """Threads, seed, quiet transformers; then `(model, tokenizer)`."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return load_for_generation(args.model, args.dtype, args.device)


def cmd_bench(args) -> int:
    _positive(args, "limit", "max_new_tokens", "threads", "pld_tokens", "early_exit_layer")
    _check_drafting_flags(args)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    _int_list(args.tree, "--tree")
    _locate(args.model)
    _questions(args)  # a bad prompt file fails before the model is loaded
    from .evaluation import bench

    if args.batch_size is not None:
        sizes = _int_list(args.batch_size, "--batch-size", "1,4,16")
        if not sizes or min(sizes) < 1 or max(sizes) > 64:
            raise ValueError(f"--batch-size takes batch sizes from 1 to 64, got {args.batch_size!r}")
        questions = _questions(args)
        _writable_file(args.output)
        model, tokenizer = _setup(args)
        report = bench.run_batch_bench(model, tokenizer, questions, sizes, args.max_new_tokens, args.chat,
                                       args.warmup, progress=not args.no_progress,
                                       log=lambda m: print(f"hf-bpd: {m}", file=sys.stderr))
        report = {"settings": {"model": args.model, "questions": args.questions, "limit": args.limit,
                               "max_new_tokens": args.max_new_tokens, "batch_sizes": sizes, "dtype": args.dtype,
                               "threads": args.threads},
                  "machine": bench.machine_info(), **report}
        print(bench.markdown_batch_report(report), end="")
        if args.output:
            Path(args.output).write_text(json.dumps(report, indent=1))
            print(f"wrote {args.output}")
        return 0
    options = bench.BenchOptions(tree_widths=tuple(_int_list(args.tree, "--tree")), num_drafts=args.num_drafts,
                                 draft_top_k=args.draft_top_k, pld_tokens=args.pld_tokens,
                                 early_exit_layer=args.early_exit_layer, num_heads_to_use=args.num_heads_to_use,
                                 draft_nodes=args.draft_nodes)
    decoders = bench.default_decoders(options)
    methods = bench.parse_methods(args.methods or ",".join(bench.DEFAULT_METHODS), list(decoders))
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
                     "multi_turn": args.multi_turn, "warmup": args.warmup, "seed": args.seed, "dtype": args.dtype,
                     "tree": list(options.tree_widths), "num_drafts": options.num_drafts,
                     "draft_nodes": options.draft_nodes,
                     "draft_top_k": options.draft_top_k, "pld_tokens": options.pld_tokens,
                     "num_heads_to_use": options.num_heads_to_use,
                     "early_exit_layer": options.early_exit_layer},
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
                         "(README: Errors and limits)")
    top_ks = _int_list(args.top_k, "--top-k", "1,2,4,8,16")
    _locate(args.model)
    questions = _questions(args)
    _writable_file(args.output)
    _writable_dir(args.plot)
    from .evaluation import analysis, bench
    from .rescorers import available_rescorers, resolve_rescorer

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


def _add_common(p, model_default: str | None = "smollm2-135m-instruct", questions=True, plot=True,
                progress=True) -> None:
    p.add_argument("--model", default=model_default, required=model_default is None,
                   help="heads checkpoint directory, or a base model (local dir, Hub id, packaged alias)"
                        + ("" if model_default else " (required)"))
    if questions:
        p.add_argument("--questions", default=DEFAULT_QUESTIONS,
                       help="prompt file: MT-bench JSONL (question_id, category, turns), Alpaca JSON/JSONL "
                            "(instruction, input) or text, one prompt per line")
        p.add_argument("--limit", type=int, default=None, help="use only the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the tokenizer's chat template (default: when the tokenizer has one)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--output", metavar="FILE.json", help="write every figure as JSON (default: none)")
    if plot:
        p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (default: none)")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


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


def _local_checkpoint_config(model: str, flag: str) -> Path:
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{flag} writes into a local checkpoint's config.json; {config_file} does not exist: pass "
                         "--model DIR (a heads checkpoint directory), or drop " + flag)
    return config_file


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
    from .evaluation.tuning import ALPHA_GRID, tune_alpha

    model, tokenizer = _setup(args)
    if not hasattr(model, "heads"):
        raise ValueError(f"{args.model} is a plain base model: tune-alpha needs a heads checkpoint directory")
    rescorer = getattr(model, "bundled_rescorers", {}).get(args.rescorer)
    if rescorer is None:
        raise ValueError(f"{args.model} bundles no {args.rescorer} rescorer")
    from .evaluation.bench import encode_messages

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
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        print(f"saved α = {result['alpha']:g} to {config_file}")
    return 0


def cmd_export(args) -> int:
    if not _is_heads_checkpoint(args.checkpoint):
        raise ValueError(f"{args.checkpoint} is not a heads checkpoint directory (no config.json with model_type "
                         "blockwise_parallel): pass a directory written by save_pretrained or train_heads")
    from .hub.export import check_exportable, export_heads

    check_exportable(json.loads((Path(args.checkpoint) / "config.json").read_text()).get("head_type"))  # before loading
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise ValueError(f"--output {args.output} is a file: pass a directory")
    import torch

    from .modeling import BlockwiseParallelForCausalLM

    torch.set_num_threads(args.threads)
    model = BlockwiseParallelForCausalLM.from_pretrained(args.checkpoint)
    out = export_heads(model, args.output, args.format)
    print(f"wrote {args.format} heads ({model.config.num_heads} heads, draft vocabulary {model.config.draft_size}) "
          f"to {out}")
    return 0


def cmd_calibrate(args) -> int:
    from .evaluation.bench import encode_messages
    from .evaluation.calibration import calibrate, reliability_table

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
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        print(f"saved head_calibration to {config_file}")
    return 0


def _train_arguments(argv: list[str], prog: str):
    """Parse `hf-bpd train`'s options with train_heads' own parser (`hf_bpd.training.arguments`, which imports
    nothing heavy): `--help` is instant and lists every default, and bad flags are one-line errors."""
    from .training.arguments import build_parser

    return build_parser(prog, parser_class=_Parser, formatter_class=_RawFormatter).parse_args(argv)


def cmd_train(args, rest: list[str] | None = None) -> int:
    """Run `hf_bpd.training.train_heads` in this process (its options follow `train`). Its options, its data files
    and its base model are checked first, before the trainer's heavy imports."""
    rest = rest or []
    options = _train_arguments(rest, "hf-bpd train")
    missing = [f for f in options.data if not Path(f).is_file()]
    if missing:
        raise ValueError(f"--data: no file {missing[0]}: pass existing ShareGPT/Alpaca JSON or JSONL files")
    _locate(options.model)
    if options.init_from:
        _locate(options.init_from)
    from .training.train_heads import main as train_main

    try:
        train_main(rest, prog="hf-bpd train")
    except SystemExit as done:
        if isinstance(done.code, str):  # train_heads' own one-line errors
            message = done.code.strip().splitlines()[0] if done.code.strip() else "training stopped"
            print(message if message.startswith("hf-bpd") else f"hf-bpd: error: {message}", file=sys.stderr)
            return 2
        return done.code if isinstance(done.code, int) else 0
    return 0


def cmd_profile(args) -> int:
    from .evaluation import cost

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


def build_parser() -> argparse.ArgumentParser:
    """The `hf-bpd` parser. Builds without importing torch or transformers (so `--help` is instant)."""
    parser = _Parser(prog="hf-bpd", formatter_class=_Formatter,
                     description="Blockwise parallel decoding for transformers: drafting heads, rescored drafts, "
                                 "exact verification. Every subcommand has --help; --debug shows tracebacks.")
    _debug_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, description: str | None = None, **kwargs):
        p = sub.add_parser(name, help=help, description=description or help[0].upper() + help[1:] + ".",
                           formatter_class=_Formatter, **kwargs)
        _debug_flag(p)
        return p

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
    gen.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype")
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
    gen.add_argument("--draft-schedule", choices=["fixed", "cost"], default=None,
                     help="fixed: verify every drafted token; cost: only those expected to pay for their verification "
                          "(calibrated head confidences x this machine's forward costs) (default: the checkpoint's)")
    gen.add_argument("--draft-nodes", type=int, default=None, metavar="N",
                     help=f"verify N draft tokens per step, 1-{MAX_DRAFT_NODES}: the p-best paths and prompt lookup's "
                          "copy compete for them, likeliest first (default: the checkpoint's)")
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
    gen.set_defaults(func=cmd_generate)

    bench = command(
        "bench", "decoding methods side by side on a prompt file (speed, block efficiency, exactness)",
        "Runs decoding methods on every prompt, alternating their order per prompt, against plain "
        "greedy decoding (ar) in the same run, and prints a Markdown table per method (and per "
        "category): tokens/s, speed-up vs ar, block efficiency (tokens per serial call), mean "
        "accepted draft tokens, draft time share, and whether every output is token-identical to ar. "
        "Methods that do not apply (no heads, no bundled rescorer, architecture refused by "
        "transformers) are listed as skipped. --output writes every per-prompt figure as JSON.")
    _add_common(bench)
    bench.add_argument("--methods", default=None,
                       help="comma-separated methods: ar, pld, early-exit, default, pbest, pbest-ngram, tree, "
                            "tree+ngram, pbest-ngram+lookup[-nodes][-compiled], ar-compiled, and bpd[+RESCORER][+lookup][-compiled][-cost] (ar always runs) "
                            f"(default: {','.join(BENCH_DEFAULT_METHODS)})")
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
    bench.add_argument("--warmup", type=int, default=1, help="uncounted warm-up generations per method")
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
    prof.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype")
    prof.add_argument("--device", default="cpu", help=DEVICE_HELP)
    prof.add_argument("--output", metavar="FILE.json", help="also write the table as JSON (default: none)")
    prof.set_defaults(func=cmd_profile)

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

    from .rescorers.kenlm import add_parser as add_build_ngram

    _debug_flag(add_build_ngram(sub, formatter_class=_Formatter))

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

    export = command(
        "export", "write trained heads in a serving engine's format (vLLM's Medusa draft model)",
        "Writes the checkpoint's heads as a vLLM Medusa draft model (config.json + model.safetensors): resblock heads "
        "only (FFN and hydra heads have no Medusa form and are refused). Serve with vLLM's speculative decoding, "
        "method 'medusa', model=OUTPUT (README \"Serve with vLLM\").")
    export.add_argument("checkpoint", help="heads checkpoint directory")
    export.add_argument("--format", default="vllm-medusa", choices=["vllm-medusa"], help="export format")
    export.add_argument("--output", required=True, metavar="DIR", help="directory to write (required)")
    export.add_argument("--threads", type=int, default=2, help="torch threads")
    export.set_defaults(func=cmd_export)

    train = sub.add_parser("train", help="train heads: runs hf_bpd.training.train_heads (training/train_heads.py; see "
                                         "its --help)", add_help=False)
    train.set_defaults(func=cmd_train)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if text else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    train = "train" in argv[:2] and argv.index("train") == (1 if argv[:1] == ["--debug"] else 0)
    debug = bool(os.environ.get("HF_BPD_DEBUG")) or (
        "--debug" in (argv[: argv.index("train")] if train else argv))
    if train:  # everything after `train` belongs to training/train_heads.py
        rest = argv[argv.index("train") + 1:]
        if "--debug" in rest:
            debug, rest = True, [a for a in rest if a != "--debug"]
        return _run(lambda: cmd_train(None, rest), debug)
    args = build_parser().parse_args(argv)

    def command():
        if getattr(args, "device", None) is not None:
            _check_device(args.device)  # its form, before any import or model load
        return args.func(args)

    return _run(command, debug or getattr(args, "debug", False))


def _run(command, debug: bool) -> int:
    """Run a subcommand: user errors are one line on stderr (exit 2), bugs one line too (exit 1), unless `debug`."""
    from .errors import BPDError

    try:
        return command()
    except KeyboardInterrupt:
        print("hf-bpd: error: interrupted", file=sys.stderr)
        return 130
    except (BPDError, ValueError, OSError) as err:
        if debug:
            raise
        print(f"hf-bpd: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a bug still gets one line; --debug shows the traceback
        if debug:
            raise
        print(f"hf-bpd: error: unexpected {type(err).__name__}: {_one_line(err)} (--debug shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
