"""What every `hf-bpd` subcommand shares: the one-line-error parser, the checks of flags, files and model names
(run before torch is imported), and loading a checkpoint or base model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..limits import MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, MAX_NUM_DRAFTS

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
DEFAULT_QUESTIONS = "benchmarks/dev_prompts.jsonl"
# Built-in rescorer names and bench's default methods, written out so that the parser needs no import of torch
# (tests keep them equal to `hf_bpd.available_rescorers()` and `hf_bpd.evaluation.bench.DEFAULT_METHODS`).
RESCORER_NAMES = ("neural", "ngram")
BENCH_DEFAULT_METHODS = ("ar", "ar-compiled", "llama.cpp", "pld", "early-exit", "bpd", "bpd+ngram", "bpd+neural",
                         "pbest", "pbest-ngram", "tree", "tree+ngram", "default")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
QUANTIZE = ("int8",)
DEVICE_HELP = "where the model runs: cpu, cuda, cuda:N, mps, or auto (transformers' device_map='auto')"


def dtype_name(text: str) -> str:
    """`--dtype`: a torch dtype name or its short form (fp32, bf16, fp16)."""
    return DTYPE_ALIASES.get(text, text)


def _add_dtype(p, quantize: bool = False) -> None:
    """`--dtype` (a torch dtype name or its short form) and, with `quantize`, `--quantize int8`."""
    p.add_argument("--dtype", default=None, type=dtype_name, choices=DTYPES,
                   help="model dtype (also fp32, bf16, fp16; default: a checkpoint's own where hf_bpd's kernels run "
                        "it, else float32; bfloat16 with --quantize int8)")
    if quantize:
        p.add_argument("--quantize", default=None, choices=QUANTIZE,
                       help="the base's linear layers with int8 weights and bf16 activations (hf_bpd's "
                            "Int8WeightsConfig: compiled, exact) (default: off)")


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


def load_model(name_or_path: str, dtype: str | None = None, device: str = "cpu", quantize: str | None = None):
    """A heads checkpoint directory (with its base) or a plain base model, in `dtype` (default: a checkpoint's own,
    `default_base_dtype`; float32 for a plain base) on `device` (`"auto"`: transformers' `device_map="auto"`);
    `quantize="int8"`: the base's linear layers with int8 weights and bf16 activations (`hf_bpd.Int8WeightsConfig`;
    `dtype` bfloat16, its default then)."""
    import torch

    from ..hub.base_models import load_base_model
    from ..modeling import BlockwiseParallelForCausalLM
    from ..runtime.int8_weights import Int8WeightsConfig

    _check_device(device)
    checkpoint = _is_heads_checkpoint(name_or_path)
    dtype = dtype_name(dtype or ("bfloat16" if quantize else None if checkpoint else "float32"))
    options = {"dtype": getattr(torch, dtype) if dtype else None}
    if device != "cpu":
        options["device_map"] = device
    if quantize is not None:
        if quantize not in QUANTIZE:
            raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {quantize[:20]!r}")
        if dtype != "bfloat16":
            raise ValueError(f"--quantize int8 computes with bf16 activations: pass --dtype bf16, not {dtype}")
        options["quantization_config"] = Int8WeightsConfig()
    if checkpoint:
        return BlockwiseParallelForCausalLM.from_pretrained(name_or_path, **options)
    return load_base_model(name_or_path, **options)


def load_for_generation(name_or_path: str, dtype: str | None = None, device: str = "cpu", quantize: str | None = None):
    """`(model, tokenizer)`: `load_model` and the tokenizer (a checkpoint's is its base's)."""
    from ..hub.base_models import load_tokenizer

    return load_model(name_or_path, dtype, device, quantize), load_tokenizer(name_or_path)


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


def _check_drafting_flags(args) -> None:
    """Ranges of the drafting flags (the ones that depend on the checkpoint are checked once it is loaded)."""
    _positive(args, "num_drafts", "draft_top_k", "num_heads_to_use", "draft_nodes")
    for name, high in (("draft_top_k", MAX_DRAFT_TOP_K), ("num_drafts", MAX_NUM_DRAFTS),
                       ("draft_nodes", MAX_DRAFT_NODES)):
        value = getattr(args, name, None)
        if value is not None and value > high:
            raise ValueError(f"--{name.replace('_', '-')}: {name} must be an integer in [1, {high}], got {value} "
                             "(docs/reliability.md: Ceilings)")


def _locate(name: str | None, what: str = "model") -> None:
    """Fail in one line, before torch is imported, when `--model` (or another model flag, named `what` in the
    message) cannot be found (`hf_bpd.hub.locate`)."""
    if name is not None:
        from ..hub.locate import locate

        locate(name, what)


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
    from ..evaluation.bench import load_questions

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
    return load_for_generation(args.model, args.dtype, args.device, getattr(args, "quantize", None))


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
    _add_dtype(p, quantize=True)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--output", metavar="FILE.json", help="write every figure as JSON (default: none)")
    if plot:
        p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (default: none)")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _local_checkpoint_config(model: str, flag: str) -> Path:
    """The config.json that `flag` rewrites: a plain file of a local checkpoint, never a link (a Hub snapshot's files
    link into the shared blob store, which a write would change for every snapshot)."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{flag} writes into a local checkpoint's config.json; {config_file} does not exist: pass "
                         "--model DIR (a heads checkpoint directory), or drop " + flag)
    if config_file.is_symlink():
        raise ValueError(f"{flag}: {config_file} is a link (a Hub download?): copy the checkpoint into a folder of "
                         "your own (`cp -rL`) and pass that, or drop " + flag)
    return config_file


def _write_config(config_file: Path, config: dict) -> None:
    """Rewrite `config_file` whole or not at all: a temporary file beside it, renamed into place."""
    import os

    partial = config_file.with_name(f".{config_file.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(partial, config_file)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if text else type(err).__name__
