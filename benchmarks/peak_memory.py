"""Peak memory of decoding: the checkpoint's default `generate()` against the same base's plain decoding (eager
`generate()` and compiled plain), each in a process of its own (a process's peak never goes down), on Linux.

    python benchmarks/peak_memory.py --model checkpoints/qwen2.5-coder-1.5b-instruct-bpd \
        --questions benchmarks/qwen_code_prompts.jsonl --limit 2 --max-new-tokens 128 --output memory.json

Each process loads the checkpoint in the dtype it records, reads its resident memory, resets the kernel's peak
(`/proc/self/clear_refs`), decodes the prompts (compilation included: it is part of what a call holds) and reads the
peak since the reset (`VmHWM`). `loaded_mb`: resident after loading; `load_peak_mb`: the peak while loading;
`peak_mb`: the peak while decoding, the number to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

METHODS = ("eager", "ar-compiled", "default")


def _status_mb(field: str) -> float:
    """`field` of /proc/self/status (VmRSS, VmHWM) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    raise OSError(f"no {field} in /proc/self/status: this benchmark needs Linux")


def measure(model_path: str, questions: str, limit: int, max_new_tokens: int, threads: int, method: str,
            quantize: str | None = None) -> dict:
    """This process's resident memory after loading and its peak while `method` decodes the prompts (`quantize="int8"`:
    the base with int8 weights, `hf_bpd.Int8WeightsConfig`, in every process)."""
    import torch

    from hf_bpd import BlockwiseParallelForCausalLM, Int8WeightsConfig, load_tokenizer
    from hf_bpd.evaluation.bench import encode_messages, load_questions

    torch.set_num_threads(threads)
    if method == "eager":  # the base as loaded: no compiled step loaded at `from_pretrained` (its packed weights)
        os.environ["HF_BPD_OFF"] = ",".join(filter(None, [os.environ.get("HF_BPD_OFF"), "artifacts"]))
    quantized = dict(dtype=torch.bfloat16, quantization_config=Int8WeightsConfig()) if quantize == "int8" else {}
    model = BlockwiseParallelForCausalLM.from_pretrained(model_path, **quantized)
    tokenizer = load_tokenizer(model_path)
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}])
               for q in load_questions(questions)[:limit]]
    loaded, load_peak = _status_mb("VmRSS"), _status_mb("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from the current one
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False)
    new_tokens = 0
    for inputs in prompts:
        if method == "eager":
            out = model.base_lm.generate(**inputs, **settings)
        elif method == "ar-compiled":
            out = model.generate(**inputs, use_heads=False, compile="wait", **settings)
        else:
            out = model.generate(**inputs, compile="wait", **settings)
        new_tokens += out.shape[1] - inputs["input_ids"].shape[1]
    return {"method": method, "dtype": str(model.base_lm.dtype).removeprefix("torch."), "quantize": quantize,
            "loaded_mb": loaded, "load_peak_mb": load_peak, "peak_mb": _status_mb("VmHWM"),
            "new_tokens": int(new_tokens)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights (bf16 activations)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--in-process", action="store_true",
                        help="measure the one method of --methods in this process (what each child process runs)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        parser.error(f"unknown method(s) {', '.join(unknown)}: use {', '.join(METHODS)}")
    common = [args.model, args.questions, args.limit, args.max_new_tokens, args.threads]
    if args.in_process:
        if len(methods) != 1:
            parser.error("--in-process measures one method: give one to --methods")
        print(json.dumps(measure(*common, methods[0], args.quantize)))
        return 0
    from hf_bpd.evaluation.bench import machine_info, print_figures

    rows = []
    for method in methods:
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--questions", args.questions,
                               "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
                               "--threads", str(args.threads), "--methods", method, "--in-process",
                               *(["--quantize", args.quantize] if args.quantize else [])],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    peaks = {r["method"]: r["peak_mb"] for r in rows}
    result = {"peak_mb": peaks, "loaded_mb": {r["method"]: r["loaded_mb"] for r in rows},
              "load_peak_mb": {r["method"]: r["load_peak_mb"] for r in rows}, "rows": rows,
              "machine": machine_info()}
    for plain, name in (("eager", "default_vs_eager_peak"), ("ar-compiled", "default_vs_compiled_plain_peak")):
        if "default" in peaks and plain in peaks:
            result[name] = round(peaks["default"] / peaks[plain], 2)
    print_figures(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
