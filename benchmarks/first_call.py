"""The first call of a new process: `from_pretrained` + the first `generate()` (the checkpoint's defaults, compiled),
timed from the start of the process, against the base's plain eager greedy `generate()` of the same prompt in the
same process (timed after it). With an artifact built by `hf-bpd compile`, nothing is compiled in the process; without
one (a cold machine: empty `$HF_BPD_CACHE` and inductor cache) the call verifies eagerly while a worker process builds
it (`hf_bpd.runtime.background`), and `verifier` says so.

    python benchmarks/first_call.py --model checkpoints/smollm2-135m-instruct-bpd --max-new-tokens 64
    HF_BPD_CACHE=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/first_call.py   # cold
"""

import argparse
import time

START = time.perf_counter()

import torch  # noqa: E402

from hf_bpd import BlockwiseParallelForCausalLM, load_tokenizer  # noqa: E402
from hf_bpd.evaluation.bench import machine_info, print_figures  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd")
    parser.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from hf_bpd.runtime.artifacts import listing

    built_before = len(listing())
    model = BlockwiseParallelForCausalLM.from_pretrained(args.model)
    tokenizer = load_tokenizer(args.model)
    loaded = time.perf_counter() - START
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    start = time.perf_counter()
    out = model.generate(**inputs, **greedy)
    first = time.perf_counter() - start
    wall = time.perf_counter() - START
    stats = model.last_generation_stats
    start = time.perf_counter()
    plain = model.base_lm.generate(**inputs, **greedy)
    eager = time.perf_counter() - start
    new = out.shape[1] - inputs["input_ids"].shape[1]
    result = {"load_seconds": round(loaded, 2), "first_generate_seconds": round(first, 2),
              "wall_seconds_to_first_answer": round(wall, 2), "new_tokens": new,
              "first_call_tokens_per_s": round(new / first, 1),
              "eager_tokens_per_s": round((plain.shape[1] - inputs["input_ids"].shape[1]) / eager, 1),
              "speedup_vs_eager": round(eager / first * new / (plain.shape[1] - inputs["input_ids"].shape[1]), 2),
              "compile_seconds": stats.compile_seconds, "verifier": stats.verifier,
              "verifier_steps": stats.verifier_steps, "artifacts_before": built_before, "block_efficiency": round(stats.block_efficiency, 2),
              "identical": torch.equal(out, plain), "machine": machine_info()}
    print_figures(result, args.output)


if __name__ == "__main__":
    main()
