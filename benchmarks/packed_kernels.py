"""hf_bpd's packed GEMM (`hf_bpd.runtime.packed_linear`) against PyTorch's CPU kernels on SmolLM2-135M's layer shapes:
microseconds per call for 1, 4, 8 and 16 rows, random weights (in the CPU caches between calls: the output layer's
56 MB excepted, this measures arithmetic, not memory), and whether each kernel's rows equal the same rows computed
one by one (row invariance, what exact drafting in half precision needs). On CPUs with AMX the packed GEMM runs
on the tile unit (its engine in this process, `torch.ops.hf_bpd_kernels.packed_linear_engine()`); its AVX512-BF16
path is measured beside it. Then hf_bpd's ordered attention
(`csrc/ordered_attention.cpp`) against PyTorch's `scaled_dot_product_attention` on one SmolLM2 layer's static cache
(9 query heads, 3 key/value heads of 64 dims, 512 slots) with 160 and 400 positions in use.

    python benchmarks/packed_kernels.py --threads 2 --output benchmarks/results/kernels_smollm2_amd_epyc.json
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


def attention_rows(repeats: int) -> list[dict]:
    """Ordered attention vs SDPA over a 512-slot cache (a block of `rows` at `past`), with the row-invariance check:
    each row of a block equals that row's query alone with its own mask row."""
    import torch.nn.functional as F

    slots, closed = 512, torch.finfo(torch.bfloat16).min
    key = torch.randn(1, 3, slots, 64).to(torch.bfloat16)
    value = torch.randn(1, 3, slots, 64).to(torch.bfloat16)
    op = torch.ops.hf_bpd_kernels.ordered_attention
    out = []
    print("\n| attention, positions in use | rows | PyTorch SDPA (512 slots) | hf_bpd ordered attention |")
    print("| --- | ---: | ---: | ---: |")
    for past in (160, 400):
        for m in (1, 8, 16):
            query = torch.randn(1, m, 9, 64).to(torch.bfloat16).transpose(1, 2)
            mask = torch.full((1, 1, m, slots), closed, dtype=torch.bfloat16)
            for r in range(m):
                mask[..., r, :past + r + 1] = 0
            kernel = lambda q, mk: op(q, key, value, mk, None, 0.125)  # noqa: E731
            sdpa = lambda: F.scaled_dot_product_attention(query, key, value, mask, scale=0.125,  # noqa: E731
                                                         enable_gqa=True)
            whole = kernel(query, mask)
            invariant = all(torch.equal(whole[:, r], kernel(query[:, :, r:r + 1], mask[:, :, r:r + 1])[:, 0])
                            for r in range(m))
            row = {"shape": f"attention {past} positions", "rows": m, "torch_sdpa_us": per_call_us(sdpa, repeats),
                   "hf_bpd_attention_us": per_call_us(lambda: kernel(query, mask), repeats),
                   "hf_bpd_attention_row_invariant": invariant}
            out.append(row)
            print(f"| {past} | {m} | {row['torch_sdpa_us']:.1f} | {row['hf_bpd_attention_us']:.1f}"
                  f"{'' if invariant else ' (rows differ)'} |")
    return out


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
    choose = torch.ops.hf_bpd_kernels.packed_linear_engine
    engine = choose()
    print(f"CPU capability {capability}, {args.threads} threads, torch {torch.__version__}, packed GEMM engine {engine}")
    rows_out = []
    amx = engine == "amx"
    extra = " | hf_bpd bf16 (AVX512 path) | hf_bpd int8 (AVX512 path)" if amx else ""
    print("| shape | rows | PyTorch bf16 linear | hf_bpd bf16 | PyTorch int8 (`_weight_int8pack_mm`) | hf_bpd int8"
          f"{extra} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if amx else ""))
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
        if amx:  # the same kernels on the AVX512-BF16 path: the engine is switched around each call
            def on_avx512(fn):
                def call(x):
                    choose("avx512")
                    try:
                        return fn(x)
                    finally:
                        choose(engine)
                return call
            kernels["hf_bpd_bf16_avx512"] = on_avx512(packed)
            kernels["hf_bpd_int8_avx512"] = on_avx512(packed8)
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
    with torch.no_grad():
        rows_out += attention_rows(args.repeats)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
                       "torch": torch.__version__, "packed_linear_engine": engine, "rows": rows_out}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
