"""`hf-bpd export` (heads in vLLM's Medusa format) and `hf-bpd build-ngram` (a KenLM n-gram for the rescorer)."""

from __future__ import annotations

import json
from pathlib import Path

from .common import _debug_flag, _Formatter, _is_heads_checkpoint


def cmd_export(args) -> int:
    if not _is_heads_checkpoint(args.checkpoint):
        raise ValueError(f"{args.checkpoint} is not a heads checkpoint directory (no config.json with model_type "
                         "blockwise_parallel): pass a directory written by save_pretrained or train_heads")
    from ..hub.export import check_exportable, export_heads

    check_exportable(json.loads((Path(args.checkpoint) / "config.json").read_text()).get("head_type"))  # before loading
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise ValueError(f"--output {args.output} is a file: pass a directory")
    import torch

    from ..modeling import BlockwiseParallelForCausalLM

    torch.set_num_threads(args.threads)
    model = BlockwiseParallelForCausalLM.from_pretrained(args.checkpoint)
    out = export_heads(model, args.output, args.format)
    print(f"wrote {args.format} heads ({model.config.num_heads} heads, draft vocabulary {model.config.draft_size}) "
          f"to {out}")
    return 0


def add_parsers(sub, command) -> None:
    """The `build-ngram` and `export` subcommands' parsers."""
    from ..rescorers.kenlm import add_parser as add_build_ngram

    _debug_flag(add_build_ngram(sub, formatter_class=_Formatter))
    export = command(
        "export", "write trained heads in a serving engine's format (vLLM's Medusa draft model)",
        "Writes the checkpoint's heads as a vLLM Medusa draft model (config.json + model.safetensors): resblock heads "
        "only (FFN and hydra heads have no Medusa form and are refused). Serve with vLLM's speculative decoding, "
        "method 'medusa', model=OUTPUT (docs/gpus-hub-vllm.md \"Serve with vLLM\").")
    export.add_argument("checkpoint", help="heads checkpoint directory")
    export.add_argument("--format", default="vllm-medusa", choices=["vllm-medusa"], help="export format")
    export.add_argument("--output", required=True, metavar="DIR", help="directory to write (required)")
    export.add_argument("--threads", type=int, default=2, help="torch threads")
    export.set_defaults(func=cmd_export)
