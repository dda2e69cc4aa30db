"""hf_bpd's packed GEMM (`hf_bpd.runtime.packed_linear`) against PyTorch's CPU kernels on SmolLM2-135M's layer shapes:
microseconds per call for 1, 4, 8 and 16 rows, random weights (in the CPU caches between calls: the output layer's
56 MB excepted, this measures arithmetic, not memory), and whether each kernel's rows equal the same rows computed
one by one (row invariance, what exact drafting in half precision needs).

    python benchmarks/kernels.py --threads 2 --output benchmarks/results/kernels_smollm2_amd_epyc.json
"""

import argparse
import json
import time

import torch
from torch import nn

from hf_bpd.runtime.int8_weights import Int8WeightLinear
from hf_bpd.runtime.kernels import kernels_unsupported_reason
from hf_bpd.runtime.packed_linear import PackedLinear

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "output layer 49152x576": (49152, 576)}


def per_call_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def row_invariant(fn, x) -> bool:
    whole = fn(x)
    return all(torch.equal(whole[i], fn(x[i:i + 1])[0]) for i in range(len(x)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reason = kernels_unsupported_reason()
    if reason is not None:
        raise SystemExit(f"hf_bpd's kernels do not run here: {reason}")
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"CPU capability {capability}, {args.threads} threads, torch {torch.__version__}")
    rows_out = []
    print("| shape | rows | PyTorch bf16 linear | hf_bpd bf16 | PyTorch int8 (`_weight_int8pack_mm`) | hf_bpd int8 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        layer = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        int8 = Int8WeightLinear.from_linear(layer)
        packed, packed8 = PackedLinear.of(layer), PackedLinear.of(int8)
        scale = int8.weight_scale
        kernels = {
            "torch_bf16": lambda x: nn.functional.linear(x, layer.weight),
            "hf_bpd_bf16": packed,
            "torch_int8": lambda x: torch._weight_int8pack_mm(x, int8.weight, scale),
            "hf_bpd_int8": packed8,
        }
        with torch.no_grad():
            for m in (1, 4, 8, 16):
                x = torch.randn(m, k).to(torch.bfloat16)
                row = {"shape": name, "rows": m}
                for key, fn in kernels.items():
                    row[f"{key}_us"] = per_call_us(lambda: fn(x), args.repeats)
                    row[f"{key}_row_invariant"] = row_invariant(fn, x) if m > 1 else True
                rows_out.append(row)
                cells = [f"{row[f'{key}_us']:.1f}{'' if row[f'{key}_row_invariant'] else ' (rows differ)'}"
                         for key in kernels]
                print(f"| {name} | {m} | " + " | ".join(cells) + " |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
                       "torch": torch.__version__, "rows": rows_out}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
