"""The C++ compiler the compiled verification step is built with: the system's GCC, told to inline inductor's GEMM
micro-kernels for every row count.

Why (AVX-512, GCC 12): inductor's CPU GEMM template (`CppMicroGemmFP32Vec`, register block 8 × 48) dispatches the
rows of a block to `kernel<rows, 48>` functions. GCC inlines those of up to 4 rows into the caller, where the
accumulators live in registers; from 5 rows on the function is bigger than its inlining limits, stays out of line,
and keeps its accumulator array (`VectorizedN<float, rows * 3>`) in memory: 15–24 stores of 64 bytes per
multiply-accumulate step (6–8 rows do that even when inlined, until GCC's complete-peeling limits are raised too).
That, not the arithmetic, would make a 5-token block cost far more than a 4-token one. With `INLINE_FLAGS` every row
count keeps its accumulators in registers, so a GEMM of 5 to 8 rows costs little more than one of 4, with
bit-identical results (docs/performance.md, "Why the compiled step is fast").

inductor has no option for extra compiler flags, so this writes a wrapper program around the compiler it would use
(`$HF_BPD_CACHE/toolchain/hf_bpd-g++`, `compiler_wrapper.py`'s body; it also serves torch's inductor header
precompiled) and passes it as inductor's `cpp.cxx` inside the compiled step's config patch only (the user's own
`torch.compile` calls are untouched). Anything unusual (not GCC, no writable cache, the wrapper failing to run)
leaves the compiler as it is.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

# The inductor settings of hf_bpd's compiled steps (`torch.compile`d and ahead-of-time artifacts alike): frozen,
# prepacked weights and the CPU GEMM templates. inductor's own switch is honoured as torch documents it:
# `TORCHINDUCTOR_MAX_AUTOTUNE=0` builds fp32 steps without benchmarking candidate GEMM kernels (faster to build,
# slower to run); half-precision steps autotune regardless, since their row invariance needs the templates.
def autotune_off() -> bool:
    """Whether inductor's own `TORCHINDUCTOR_MAX_AUTOTUNE=0` turns GEMM autotuning off (read where it decides)."""
    return os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE") == "0"


# No precompiled headers: torch 2.13 keys each one by the whole compile command (which differs from build to build),
# so every artifact build wrote two new ~150 MB `.gch` under `/tmp/torchinductor_$USER/precompiled_headers` that no
# later build reused (tens of GB after a few hundred builds; docs/reliability.md, "The cache and what is trusted").
NO_PRECOMPILED_HEADERS = {"cpp_cache_precompile_headers": False, "aot_inductor.precompile_headers": False}
INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": not autotune_off(), "max_autotune_gemm_backends": "CPP,ATEN",
                    **NO_PRECOMPILED_HEADERS}

# Inductor splits a loop over the threads once each share holds `cpp.min_chunk_size` elements (512 in torch 2.13): in
# a one-token step that is the row's norm, a reduction over hidden_size (from 1,024 on two threads), whose partial
# sums then add in another order than the same row's in a longer block. Ordered steps keep inductor's loops serial:
# their GEMMs and attention are hf_bpd's kernels, parallel on their own.
SERIAL_LOOPS = {"cpp.min_chunk_size": 2 ** 31 - 1}
# Half-precision (position-ordered) steps, compiled in-process or ahead of time: GEMMs by inductor's CPU templates only,
# rounding to bf16 where the eager program does, loops serial (see `compiled._Patches`).
ORDERED_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP", "emulate_precision_casts": True,
                   **SERIAL_LOOPS}

# GCC's inlining limits, raised so that `kernel<rows, 48>` of every row count (1..8) is inlined, and its complete
# peeling limits, raised so that the 6..8-row kernels' accumulators (18..24 vectors) also end in registers.
INLINE_FLAGS = ("--param", "max-inline-insns-single=2000", "--param", "large-stack-frame-growth=100000",
                "--param", "large-function-growth=100000", "--param", "inline-unit-growth=100000",
                "-fno-semantic-interposition", "--param", "max-completely-peeled-insns=4000",
                "--param", "max-completely-peel-times=64")
WRAPPER_NAME = "hf_bpd-g++"  # inductor recognises GCC by "g++" in the compiler's name
# An AOTInductor package's wrapper source (the runner that calls the kernels; the GEMM micro-kernels are in the kernel
# sources) compiles without `INLINE_FLAGS`: there the raised limits only lengthen the compile.
WRAPPER_SOURCE = ".wrapper.cpp"


def inlining_compiler() -> str | None:
    """The path of the wrapper around inductor's GCC that adds `INLINE_FLAGS` (to kernel sources) in the cache now in
    use, or None where it does not apply. A process whose `$HF_BPD_CACHE` changes gets the new cache's wrapper: native
    code runs only from the cache in use, and the path is part of inductor's cache keys (an old path misses every
    compile cached since)."""
    from ..hub.locate import cache_dir

    return wrapper_in(cache_dir())


PCH_FOLDER = "pch"  # under the toolchain folder: one folder per compiler, torch and CPU (`toolchain_identity`)


def toolchain_identity(compiler: str) -> str:
    """What a precompiled header depends on besides its compile flags: the compiler, torch's headers (its version and
    install) and the CPU (`-march=native`)."""
    import hashlib

    import torch

    from .int8_heads import cpu_features

    version = subprocess.run([compiler, "--version"], check=True, capture_output=True, text=True, timeout=30).stdout
    parts = (version, torch.__version__, os.path.dirname(torch.__file__), cpu_features())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def wrapper_script(compiler: str, pch_root: Path) -> str:
    """The wrapper program: `compiler_wrapper.py`'s body run by this Python (isolated, no site packages)."""
    import sys

    body = (Path(__file__).parent / "compiler_wrapper.py").read_text()
    body = body[: body.index('if __name__ == "__main__":')]
    call = (f"sys.exit(main(sys.argv[1:], {compiler!r}, {list(INLINE_FLAGS)!r}, {WRAPPER_SOURCE!r}, "
            f"{str(pch_root)!r}))\n")
    return f"#!{sys.executable} -IS\n{body}{call}"


@functools.cache
def wrapper_in(cache: Path) -> str | None:
    """`inlining_compiler` for the cache folder `cache`, written once per process and folder. Precompiled headers of
    another compiler, torch or CPU are removed when the wrapper is rewritten for this one (bounded disk)."""
    try:
        from torch._inductor import cpp_builder

        compiler = cpp_builder.get_cpp_compiler()
        if not cpp_builder._is_gcc(compiler):
            return None
        from ..hub.locate import trusted

        folder = cache / "toolchain"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = trusted(folder) / WRAPPER_NAME
        pch_root = folder / PCH_FOLDER / toolchain_identity(compiler)
        script = wrapper_script(compiler, pch_root)
        if not path.is_file() or path.read_text() != script:
            partial = path.with_name(f"{WRAPPER_NAME}.{os.getpid()}.partial")
            partial.write_text(script)
            partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            os.replace(partial, path)
            for other in (folder / PCH_FOLDER).glob("*"):
                if other != pch_root:
                    shutil.rmtree(other, ignore_errors=True)
        trusted(path)  # run only a script of this user's own
        subprocess.run([str(path), "--version"], check=True, capture_output=True, timeout=30)
        return str(path)
    except Exception as err:  # noqa: BLE001 - the default compiler still works, only slower for 5+ row blocks
        logger.info("compiled step: keeping inductor's default compiler (%s)", err)
        return None


def compiler_options() -> dict:
    """inductor config entries for the compiled step: `{"cpp.cxx": (wrapper,)}`, or {} (see `inlining_compiler`)."""
    wrapper = inlining_compiler()
    if wrapper and not os.path.isfile(wrapper):  # the cache was cleaned while this process ran: write it again
        wrapper_in.cache_clear()
        wrapper = inlining_compiler()
    return {"cpp.cxx": (wrapper,)} if wrapper else {}
