"""How many heads pay under compiled verification: bpd+ngram with 4, 3 and 2 heads against compiled plain decoding.

    python benchmarks/compiled_heads.py   # benchmarks/bench_prompts.jsonl (10 dev prompts), 128 new tokens, 2 threads

Every method is warmed up (compiled) first, then all run on each prompt in turn; outputs must be identical.
Prints | method | tok/s | vs compiled plain | block efficiency | ms per serial call |.
"""

import time, torch, hf_bpd, json
from hf_bpd.evaluation.bench import first_turn_inputs
torch.set_num_threads(2)
m = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained("checkpoints/smollm2-135m-instruct-bpd")
tok = hf_bpd.load_tokenizer("checkpoints/smollm2-135m-instruct-bpd")
inputs = first_turn_inputs(tok, "benchmarks/bench_prompts.jsonl")
runs = {"ar-compiled": dict(use_heads=False, compile=True)}
for h in (4, 3, 2):
    runs[f"bpd+ngram-compiled h={h}"] = dict(rescorer="ngram", compile=True, num_heads_to_use=h)
for name, o in runs.items():
    t = time.perf_counter(); m.generate(**inputs[0], max_new_tokens=8, **o); print(name, "warm-up", round(time.perf_counter() - t), flush=True)
res = {k: [0, 0.0, 0] for k in runs}
for inp in inputs:
    ref = None
    for name, o in runs.items():
        t = time.perf_counter(); out = m.generate(**inp, max_new_tokens=128, **o); dt = time.perf_counter() - t
        ref = out if ref is None else ref
        assert torch.equal(out, ref)
        s = m.last_generation_stats; r = res[name]; r[0] += s.new_tokens; r[1] += dt; r[2] += s.serial_calls
base = res["ar-compiled"][0] / res["ar-compiled"][1]
print("cpu", torch.backends.cpu.get_cpu_capability())
for k, (n, sec, calls) in res.items():
    print(f"| {k} | {n/sec:.1f} | {n/sec/base:.2f}x | {n/calls:.2f} | {1000*sec/calls:.1f} |")
