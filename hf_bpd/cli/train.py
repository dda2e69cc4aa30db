"""`hf-bpd train`: `hf_bpd.training.train_heads` in this process, its options checked before the trainer's heavy
imports."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import _locate, _Parser, _RawFormatter


def _train_arguments(argv: list[str], prog: str):
    """Parse `hf-bpd train`'s options with train_heads' own parser (`hf_bpd.training.arguments`, which imports
    nothing heavy): `--help` is instant and lists every default, and bad flags are one-line errors."""
    from ..training.arguments import build_parser

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
    from ..training.train_heads import main as train_main

    try:
        train_main(rest, prog="hf-bpd train")
    except SystemExit as done:
        if isinstance(done.code, str):  # train_heads' own one-line errors
            message = done.code.strip().splitlines()[0] if done.code.strip() else "training stopped"
            print(message if message.startswith("hf-bpd") else f"hf-bpd: error: {message}", file=sys.stderr)
            return 2
        return done.code if isinstance(done.code, int) else 0
    return 0


def add_parsers(sub, command) -> None:
    """The `train` subcommand's parser (its options are train_heads')."""
    train = sub.add_parser("train", help="train heads: runs hf_bpd.training.train_heads (training/train_heads.py; see "
                                         "its --help)", add_help=False)
    train.set_defaults(func=cmd_train)
