"""`hf-bpd`: the command line. Errors in user input print one line (`hf-bpd: error: ...`) and exit 2; `--debug`
(or `HF_BPD_DEBUG=1`) shows the traceback instead.

Subcommands: `generate` (one prompt, with statistics), `bench` (decoding methods side by side on a prompt file,
`hf_bpd.evaluation.bench`), `analyze` (the paper's Section 6 analyses of block drafts, `hf_bpd.evaluation.analysis`),
`build-ngram`, `tune-alpha`, `calibrate`, `profile`, `compile` (the compiled step, built once per machine),
`export` (heads to vLLM's Medusa format), `train`.

Start-up imports nothing heavy: the parser, `--help` and the checks of flags, files and model names run before
torch and transformers are imported (measured: `hf-bpd generate --help` 4.9 s -> 0.2 s), and every flag is checked
before a model is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import artifacts, bench, generate, hub, tuning
from . import train as train_command
from .common import (BENCH_DEFAULT_METHODS, RESCORER_NAMES, _check_device, _debug_flag, _Formatter, _one_line,
                     _Parser, load_for_generation, load_model)

__all__ = ["BENCH_DEFAULT_METHODS", "RESCORER_NAMES", "build_parser", "load_for_generation", "load_model", "main"]


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

    for module in (generate, bench, tuning, artifacts, hub, train_command):  # the order of `hf-bpd --help`
        module.add_parsers(sub, command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    train = "train" in argv[:2] and argv.index("train") == (1 if argv[:1] == ["--debug"] else 0)
    debug = bool(os.environ.get("HF_BPD_DEBUG")) or (
        "--debug" in (argv[: argv.index("train")] if train else argv))
    if train:  # everything after `train` belongs to training/train_heads.py
        rest = argv[argv.index("train") + 1:]
        if "--debug" in rest:
            debug, rest = True, [a for a in rest if a != "--debug"]
        return _run(lambda: train_command.cmd_train(None, rest), debug)
    args = build_parser().parse_args(argv)

    def command():
        if getattr(args, "device", None) is not None:
            _check_device(args.device)  # its form, before any import or model load
        return args.func(args)

    return _run(command, debug or getattr(args, "debug", False))


def _run(command, debug: bool) -> int:
    """Run a subcommand: user errors are one line on stderr (exit 2), bugs one line too (exit 1), unless `debug`."""
    from ..errors import BPDError

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
