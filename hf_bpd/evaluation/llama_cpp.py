"""The `llama.cpp` methods of `hf-bpd bench`: greedy decoding of the base's GGUF file by llama.cpp, the CPU user's
usual choice, timed in the same run as the other methods: plain (`llama.cpp`), and speculative with a draft model's
GGUF (`llama.cpp-specK`: llama-cpp-python's speculative API, `Llama(draft_model=...)`, the draft model drafting `K`
greedy tokens per step on llama.cpp's own kernels, its cache reused up to the common prefix).

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


def _given_gguf(value: str | Path, flag: str) -> Path:
    """The GGUF file a command-line flag names, or the method skipped with a note saying the flag's file is none."""
    path = Path(value)
    if not path.is_file() or path.suffix != ".gguf":
        raise MethodSkipped(f"{flag} {value}: no such .gguf file")
    return path


def gguf_of(model, gguf: str | Path | None = None) -> Path:
    """The GGUF file llama.cpp decodes: `gguf` when given, else the packaged base alias's file."""
    from ..hub.base_models import PACKAGED_MODELS

    if gguf is not None:
        return _given_gguf(gguf, "--gguf")
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


def draft_gguf_of(draft: str | Path | None, assistant: str | None) -> Path:
    """The draft model's GGUF for the speculative method: `draft` when given, else the packaged GGUF of the assisted
    method's draft model (`--assistant-model`), so both draft with the same model."""
    from ..hub.base_models import PACKAGED_MODELS

    if draft is not None:
        return _given_gguf(draft, "--draft-gguf")
    if assistant in PACKAGED_MODELS:
        return PACKAGED_MODELS[assistant].gguf()
    raise MethodSkipped("llama.cpp's speculative decoding needs a draft model: pass --assistant-model with a packaged "
                        "base (e.g. qwen2.5-coder-0.5b-instruct) or --draft-gguf FILE.gguf")


class _DraftModel:
    """llama-cpp-python's draft-model interface (`LlamaDraftModel`): `k` greedy tokens of the draft GGUF after the
    sequence so far; counts its calls (one per verification step)."""

    def __init__(self, llm, k: int):
        self.llm, self.k, self.calls = llm, k, 0

    def __call__(self, input_ids, /, **kwargs):
        import numpy as np

        self.calls += 1
        out = []
        for token in self.llm.generate(input_ids.tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                       repeat_penalty=1.0):
            out.append(int(token))
            if len(out) >= self.k:
                break
        return np.array(out, dtype=np.intc)


def _llama(path: Path, threads: int, n_ctx: int, draft: tuple[Path, int] | None = None):
    try:
        import llama_cpp
    except ImportError:
        raise MethodSkipped(f"llama-cpp-python is not installed: {INSTALL}") from None
    for file in (path,) if draft is None else (path, draft[0]):
        reason = probe(file, threads)
        if reason is not None:
            raise MethodSkipped(reason)
    key = (str(path), threads, n_ctx, None if draft is None else (str(draft[0]), draft[1]))
    if key not in _LOADED:
        _close_all()  # one model (and its draft model) at a time
        if not _LOADED:
            atexit.register(_close_all)  # closed before the interpreter tears llama_cpp down
        options = dict(n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
        drafter = None
        if draft is not None:
            drafter = _DraftModel(llama_cpp.Llama(model_path=str(draft[0]), **options), draft[1])
        _LOADED[key] = llama_cpp.Llama(model_path=str(path), draft_model=drafter, **options)
    return _LOADED[key]


def _close_all() -> None:
    for llm in _LOADED.values():
        if llm.draft_model is not None:
            llm.draft_model.llm.close()
        llm.close()
    _LOADED.clear()


def decode_llama_cpp(model, inputs: dict, max_new_tokens: int, gguf: str | Path | None = None,
                     draft_tokens: int | None = None, draft_gguf: str | Path | None = None,
                     assistant: str | None = None):
    """Greedy decoding of `inputs["input_ids"]` (one prompt) by llama.cpp; `(sequences, stats)` as every decoder.
    `draft_tokens`: speculative decoding, the draft model (`draft_gguf_of`) drafting that many tokens a step."""
    if model.device.type != "cpu":
        raise MethodSkipped("the llama.cpp column runs on the CPU: bench with --device cpu")
    ids = inputs["input_ids"][0].tolist()
    n_ctx = 2048
    while n_ctx < len(ids) + max_new_tokens + 8 + (draft_tokens or 0):
        n_ctx *= 2
    draft = None if draft_tokens is None else (draft_gguf_of(draft_gguf, assistant), draft_tokens)
    llm = _llama(gguf_of(model, gguf), torch.get_num_threads(), n_ctx, draft)
    if draft is not None:  # a fresh prompt: neither cache holds anything of the previous one
        llm.reset()
        llm.draft_model.llm.reset()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]) or {llm.token_eos()}
    new: list[int] = []
    steps: list[int] = []  # speculative: the tokens decoded when each verification step was drafted
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        new.append(int(token))
        if draft is not None and len(steps) < llm.draft_model.calls:
            steps.append(len(new))
        if token in eos or len(new) >= max_new_tokens:
            break
    sequences = torch.tensor([ids + new], dtype=torch.long)
    if draft is None:
        return sequences, GenerationStats(method="llama.cpp", new_tokens=len(new), accepted_lengths=[0] * len(new))
    # the prompt pass yields the first token, each verification step the draft tokens it accepted plus its own
    bounds = [1, *steps, len(new) + 1]
    return sequences, GenerationStats(method=f"llama.cpp-spec{draft_tokens}", new_tokens=len(new),
                                      accepted_lengths=[b - a - 1 for a, b in zip(bounds, bounds[1:])])
