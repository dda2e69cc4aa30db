"""Where a compiled verification step's time goes, per block length: the GEMMs, the attention kernel over the static
cache, dynamo's guard checks and the rest (torch.profiler self times, 5 steps after 10 timed ones).

    python benchmarks/block_profile.py --lengths 4,5 --past 200 [--cache 1024]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf_bpd
from hf_bpd.runtime import compiled as verify_runtime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct-bpd")
    p.add_argument("--lengths", default="4,5", help="block lengths, comma-separated")
    p.add_argument("--past", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--cache", type=int, default=None,
                   help="tokens the static cache must hold (default: past + 256; rounded up to the runner's bucket)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", type=int, default=0,
                   help="also list the N costliest kernels of the compiled graph per block length (inductor's "
                        "cpp.enable_kernel_profile; compiles its own graphs)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.kernels:
        torch._inductor.config.cpp.enable_kernel_profile = True
    base = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(args.model).base_lm
    runner = verify_runtime.compiled_runner(base, args.cache or args.past + 256)
    lengths = [int(x) for x in args.lengths.split(",")]
    runner.warm_up(lengths, base.device)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, static cache {runner.max_cache_len} slots, "
          f"compile seconds {({k: round(v) for k, v in runner.compiled_buckets.items()})}")
    for b in lengths:
        mask = torch.zeros(1, 1, b, runner.max_cache_len, dtype=base.dtype)
        mask[..., args.past + b:] = torch.finfo(base.dtype).min
        positions = args.past + torch.arange(b)
        tokens = torch.zeros(1, b, dtype=torch.long)

        def step():
            runner.run(tokens, positions[None], positions, mask)
            runner.set_length(args.past)

        with torch.no_grad():
            runner.set_length(args.past)
            for _ in range(3):
                step()
            times = []
            for _ in range(10):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
        per_step = {e.key: e.self_cpu_time_total / 5 / 1000 for e in prof.key_averages()}
        # self times: the GEMM templates (or library matmuls), the attention kernel, dynamo's guards, the rest
        parts = {"GEMMs": ("gemm", "mkl", "linear", "aten::mm", "addmm"), "attention": ("scaled_dot_product",),
                 "guards": ("Cache Lookup",)}
        ms = {part: sum(v for k, v in per_step.items() if any(n in k for n in names) and
                        not (part == "GEMMs" and "scaled_dot_product" in k)) for part, names in parts.items()}
        print(f"block {b}: {1000 * sorted(times)[5]:.1f} ms per step (median of 10); "
              + ", ".join(f"{part} {v:.1f} ms" for part, v in ms.items())
              + f", the rest {sum(per_step.values()) - sum(ms.values()):.1f} ms")
        if args.kernels:
            ranked = sorted(((v, k) for k, v in per_step.items() if "CompiledFxGraph" not in k), reverse=True)
            for value, name in ranked[: args.kernels]:
                print(f"    {value:7.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
