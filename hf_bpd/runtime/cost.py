"""The cost model: what one verification forward of n tokens costs on this machine, eager and compiled.

`measure_costs` times one base forward of n new tokens on a KV cache holding `past` tokens, for every n asked for,
eagerly (a `DynamicCache`, as plain `generate()` runs) and through the compiled step of `generate(compile=True)`
(`hf_bpd.generation.verify`), next to the physical bound: the bytes of the weights one forward reads divided by the
measured memory read bandwidth (the same for 1 and 16 tokens while the forward is bandwidth-bound). `hf-bpd profile`
prints the table and stores it as JSON under `$HF_BPD_CACHE/costs/`, keyed by model, dtype and CPU capability.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
import weakref
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from ..kv_cache import CACHE_NAME
from ..hub.base_models import cache_dir, fingerprint
from .cache_files import store_json

_EAGER_MS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> {n: eager ms}, this process's


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Measured read bandwidth in GB/s: the median time of `sum()` over a `megabytes` fp32 tensor."""
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(base) -> int:
    """Bytes of the parameters one forward reads (shared tensors once; int8 weights are buffers)."""
    seen, total = set(), 0
    for p in [*base.parameters(), *base.buffers()]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def measure_costs(base, lengths, compiled: bool = True, past: int = 200, repeats: int = 7) -> dict:
    """`{"lengths", "eager_ms", "compiled_ms", "compile_seconds", "bound_ms", ...}` for one base model."""
    device = base.device
    vocab = base.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, past), device=device)
    cache = DynamicCache(config=base.config.get_text_config(decoder=True))
    cache.activate_past_recording()  # sliding-window layers keep what the crop after each timed forward needs
    base(input_ids=prompt, **{CACHE_NAME: cache}, use_cache=True, logits_to_keep=1)
    eager, compiled_ms, compile_seconds = [], [], []

    for n in lengths:
        block = torch.randint(0, vocab, (1, n), device=device)

        def eager_step():
            base(input_ids=block, **{CACHE_NAME: cache}, use_cache=True)
            cache.crop(-n)

        eager.append(_median_ms(eager_step, repeats))
    if compiled:
        from .compiled import compiled_runner

        runner = compiled_runner(base, past + max(lengths))
        with runner.lock:
            for n in lengths:
                start = time.perf_counter()
                runner.warm_up([n], device)
                compile_seconds.append(time.perf_counter() - start)
                tokens = torch.randint(0, vocab, (1, n), device=device)
                mask = torch.zeros(1, 1, n, runner.max_cache_len, dtype=base.dtype, device=device)
                mask[..., past + n:] = torch.finfo(base.dtype).min
                positions = past + torch.arange(n, device=device)

                def compiled_step():
                    runner.set_length(past)
                    runner.run(tokens, positions[None], positions, mask)

                compiled_ms.append(_median_ms(compiled_step, repeats))
            runner.reset()
    bandwidth = memory_bandwidth()
    weights = weight_bytes(base)
    return {
        "lengths": list(lengths), "past": past, "eager_ms": eager, "compiled_ms": compiled_ms or None,
        "compile_seconds": compile_seconds or None, "weight_bytes": weights, "bandwidth_gb_s": bandwidth,
        "bound_ms": 1000 * weights / (bandwidth * 1e9), "dtype": str(base.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
    }


def cost_table(costs: dict) -> str:
    """Markdown: one row per block length, eager and compiled ms and their ratio to a one-token step."""
    one_e = costs["eager_ms"][0]
    compiled = costs.get("compiled_ms") or [None] * len(costs["lengths"])
    one_c = compiled[0]
    lines = [f"forward of n new tokens on a {costs['past']}-token cache; {costs['dtype']}, {costs['threads']} threads, "
             f"CPU capability {costs['cpu_capability']}; bound = {costs['weight_bytes'] / 1e6:.0f} MB of weights / "
             f"{costs['bandwidth_gb_s']:.1f} GB/s = {costs['bound_ms']:.1f} ms", "",
             "| n | eager ms | eager / n=1 | compiled ms | compiled / n=1 | bound ms |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, e, c in zip(costs["lengths"], costs["eager_ms"], compiled):
        comp = "– | –" if c is None else f"{c:.1f} | {c / one_c:.2f}"
        lines.append(f"| {n} | {e:.1f} | {e / one_e:.2f} | {comp} | {costs['bound_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def cost_file(base) -> Path:
    """Where `hf-bpd profile` stores the table for this model, dtype and CPU."""
    key = f"{fingerprint(base).split(':')[-1][:16]}-{str(base.dtype).replace('torch.', '')}-" \
          f"{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}t"
    return cache_dir() / "costs" / f"{key}.json"


def save_costs(base, costs: dict) -> Path:
    path = cost_file(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs, indent=1))
    return path


def load_costs(base) -> dict | None:
    """The table `hf-bpd profile` stored for this model, dtype, CPU capability and thread count, if any."""
    path = cost_file(base)
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None


def eager_cost_file(base) -> Path:
    """Where eager forward costs measured during decoding are kept for this model, dtype, CPU and thread count."""
    path = cost_file(base)
    return path.with_name(f"{path.stem}-eager.json")


def _read_lengths(path: Path) -> dict[int, float]:
    try:
        table = json.loads(path.read_text())
        return {int(n): float(ms) for n, ms in zip(table["lengths"], table["eager_ms"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


@torch.no_grad()
def eager_costs_at(base, lengths, past: int = 128, repeats: int = 3) -> dict[int, float]:
    """`{n: ms}` of the base's eager forward of `n` tokens, for every `n` in `lengths` (and any looked up before): the
    stored `hf-bpd profile` table where it has them, then the lengths measured before on this machine
    (`eager_cost_file`), the rest measured now and added to that file (timing a length takes several forwards, so
    the first eager drafted call on a machine pays it, not every process). One table per process and base, the same
    dict on every call."""
    known = _EAGER_MS.setdefault(base, {})
    if all(n in known for n in lengths):
        return known
    stored = load_costs(base)
    if stored is not None:
        for n, ms in zip(stored["lengths"], stored["eager_ms"]):
            known.setdefault(n, ms)
    path = eager_cost_file(base)
    on_file = _read_lengths(path) if any(n not in known for n in lengths) else {}
    for n, ms in on_file.items():
        known.setdefault(n, ms)
    missing = [n for n in lengths if n not in known]
    if missing:
        measured = measure_costs(base, missing, compiled=False, past=past, repeats=repeats)
        fresh = dict(zip(measured["lengths"], measured["eager_ms"]))
        known.update(fresh)
        kept = {**on_file, **fresh}
        # best effort: a read-only cache only means measuring again in the next process
        store_json(path, {"lengths": sorted(kept), "eager_ms": [kept[n] for n in sorted(kept)], "past": past,
                          "threads": torch.get_num_threads()})
    return known

