"""The `llama.cpp` method of `hf-bpd bench`: plain greedy decoding of the base's GGUF file by llama.cpp, the CPU
user's usual choice for a small model, timed in the same run as the other methods.

It needs `llama-cpp-python` (an optional extra, `pip install "hf_bpd[llama]"`, which builds llama.cpp for this CPU
in about 8 minutes); without it the method is skipped with a note. The GGUF is the packaged base's own file (the
`smollm2-135m-instruct` and `gemma-3-270m` aliases) or `--gguf PATH`. llama.cpp is fed the very token ids the
other methods get (the prompt through the tokenizer's chat template), decodes with its greedy sampler (temperature
0, no repetition penalty) on as many threads as torch uses, and stops at the base's end-of-sequence tokens or the
token budget; the prompt pass is timed, as for every method. Its weights are the GGUF's quantized ones, read by
llama.cpp's own kernels, so its output may differ from the dequantized base's (the report's `exact` says).

llama.cpp is first run once in a child process (`probe`): a build whose kernels crash on this CPU (llama.cpp's AMX
backend segfaults on some Intel Xeons, ggml-org/llama.cpp#20824) would otherwise take the whole bench down with it;
the column is then skipped with the way to rebuild llama.cpp without AMX.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import sys
from pathlib import Path

import torch

from ..errors import MethodSkipped
from ..generation.stats import GenerationStats

INSTALL = "pip install 'hf_bpd[llama]' (builds llama.cpp, ~8 minutes)"
_LOADED: dict[tuple, object] = {}  # (path, threads, n_ctx) -> llama_cpp.Llama: loaded once per process
_PROBED: dict[tuple, str | None] = {}  # (path, threads) -> why llama.cpp cannot decode it here (None: it can)
NO_AMX = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
          '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
          'pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python')
# loads the GGUF and decodes 4 tokens greedily: what the column does, in a child process
PROBE = ("import sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), "
         "verbose=False); [t for _, t in zip(range(4), m.generate([1, 2, 3], top_k=1, temp=0.0))]; m.close()")


def gguf_of(model, gguf: str | Path | None = None) -> Path:
    """The GGUF file llama.cpp decodes: `gguf` when given, else the packaged base alias's file."""
    from ..hub.base_models import PACKAGED_MODELS

    if gguf is not None:
        path = Path(gguf)
        if not path.is_file() or path.suffix != ".gguf":
            raise MethodSkipped(f"--gguf {gguf}: no such .gguf file")
        return path
    base = getattr(model, "base_lm", model)
    names = [getattr(model.config, "base_model_name_or_path", None), base.config.name_or_path]
    alias = next((n for n in names if n in PACKAGED_MODELS), None)
    if alias is None:
        raise MethodSkipped(f"the base ({names[0] or names[1]}) is not a packaged GGUF base: pass --gguf PATH for "
                            "the llama.cpp column")
    return PACKAGED_MODELS[alias].gguf()


def probe(path: Path, threads: int, timeout: float = 120) -> str | None:
    """Why llama.cpp cannot decode `path` on this machine (a crash or an error in a child process), or None when
    it can; once per process and file."""
    key = (str(path), threads)
    if key not in _PROBED:
        try:
            done = subprocess.run([sys.executable, "-c", PROBE, str(path), str(threads)], capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            _PROBED[key] = f"llama.cpp did not decode 4 tokens of {path.name} within {timeout:.0f} s"
        else:
            if done.returncode < 0:
                name = signal.Signals(-done.returncode).name
                _PROBED[key] = (f"llama.cpp crashed ({name}) decoding {path.name} on this CPU (its AMX kernels do on "
                                f"some Xeons, ggml-org/llama.cpp#20824); rebuild it without AMX: {NO_AMX}")
            elif done.returncode:
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                _PROBED[key] = f"llama.cpp failed on {path.name}: {last}"
            else:
                _PROBED[key] = None
    return _PROBED[key]


def _llama(path: Path, threads: int, n_ctx: int):
    try:
        import llama_cpp
    except ImportError:
        raise MethodSkipped(f"llama-cpp-python is not installed: {INSTALL}") from None
    reason = probe(path, threads)
    if reason is not None:
        raise MethodSkipped(reason)
    key = (str(path), threads, n_ctx)
    if key not in _LOADED:
        _close_all()  # one model at a time
        if not _LOADED:
            atexit.register(_close_all)  # closed before the interpreter tears llama_cpp down
        _LOADED[key] = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                       n_threads_batch=threads, verbose=False)
    return _LOADED[key]


def _close_all() -> None:
    for llm in _LOADED.values():
        llm.close()
    _LOADED.clear()


def decode_llama_cpp(model, inputs: dict, max_new_tokens: int, gguf: str | Path | None = None):
    """Greedy decoding of `inputs["input_ids"]` (one prompt) by llama.cpp; `(sequences, stats)` as every decoder."""
    if model.device.type != "cpu":
        raise MethodSkipped("the llama.cpp column runs on the CPU: bench with --device cpu")
    ids = inputs["input_ids"][0].tolist()
    n_ctx = 2048
    while n_ctx < len(ids) + max_new_tokens + 8:
        n_ctx *= 2
    llm = _llama(gguf_of(model, gguf), torch.get_num_threads(), n_ctx)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]) or {llm.token_eos()}
    new: list[int] = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        new.append(int(token))
        if token in eos or len(new) >= max_new_tokens:
            break
    sequences = torch.tensor([ids + new], dtype=torch.long)
    return sequences, GenerationStats(method="llama.cpp", new_tokens=len(new), accepted_lengths=[0] * len(new))
