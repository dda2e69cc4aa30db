"""`hf-bpd`: the command line. Errors in user input print one line (`hf-bpd: error: ...`) and exit 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def load_for_generation(name_or_path: str, dtype: str = "float32"):
    """`(model, tokenizer)` for a heads checkpoint directory (with its base) or a plain base model name."""
    import torch

    from .base_models import load_base, load_tokenizer
    from .modeling import BlockwiseParallelForCausalLM

    torch_dtype = getattr(torch, dtype)
    config_file = Path(name_or_path) / "config.json"
    if config_file.exists() and json.loads(config_file.read_text()).get("model_type") == "blockwise_parallel":
        model = BlockwiseParallelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype)
        return model, load_tokenizer(name_or_path)
    return load_base(name_or_path, dtype=torch_dtype)


def _encode(tokenizer, prompt: str, chat: bool):
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("this tokenizer has no chat template: drop --chat")
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_for_generation(args.model, args.dtype)
    inputs = _encode(tokenizer, args.prompt, args.chat)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    if args.do_sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.no_heads:
        kwargs["use_heads"] = False
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.stream else None

    start = time.perf_counter()
    out = model.generate(**inputs, streamer=streamer, **kwargs)
    seconds = time.perf_counter() - start
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    if not args.stream:
        print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print("---")
    stats = getattr(model, "last_generation_stats", None)
    print(f"new tokens: {new_tokens}  time: {seconds:.2f} s  speed: {new_tokens / seconds:.1f} tok/s")
    if stats is not None:
        print(f"block efficiency: {stats.block_efficiency:.2f} tokens per serial call "
              f"({stats.serial_calls} calls, mean accepted draft tokens {stats.mean_accepted:.2f})")
    if args.compare:
        base = getattr(model, "base_lm", model)
        start = time.perf_counter()
        ref = base.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        ref_seconds = time.perf_counter() - start
        same = torch.equal(ref, out) if not args.do_sample else None
        print(f"plain greedy: {(ref.shape[1] - inputs['input_ids'].shape[1]) / ref_seconds:.1f} tok/s  "
              f"speed-up: {ref_seconds / seconds:.2f}x" + ("" if same is None else f"  identical output: {same}"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-bpd", description="Blockwise parallel decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text and print generation statistics")
    gen.add_argument("--model", default="smollm2-135m-instruct",
                     help="heads checkpoint directory, or a base model (local dir, Hub id, packaged alias)")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--threads", type=int, default=2)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--no-heads", action="store_true", help="plain decoding with the base model")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    gen.add_argument("--compare", action="store_true",
                     help="also run the base's plain greedy generate() and report the speed-up")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import BPDError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (BPDError, ValueError, FileNotFoundError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"hf-bpd: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
