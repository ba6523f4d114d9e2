#!/usr/bin/env bash
# Install the llama.cpp backend (`--backend llamacpp`): llama-cpp-python, built from source here.
# Its version is pinned in pyproject.toml (extra "llamacpp"); its build flags live in this file only.
# pip keeps the built wheel in its cache, so a second run takes seconds.
#   -DGGML_NATIVE=ON   kernels for this machine's CPU (AVX2 / AVX512 / AVX512-BF16 / AMX as present)
#   -DLLAVA_BUILD=OFF  no multimodal library (not used), a shorter build
#   -DLLAMA_CURL=OFF   no downloads from llama.cpp itself
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_ARGS="${SPECDECODE_LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
echo "installing the llama.cpp backend: llama-cpp-python built from source, about 10 minutes on 2 cores" \
     "(a wheel pip has cached: seconds)" >&2
( start=$SECONDS; while sleep 10; do echo "  ... still building llama-cpp-python ($((SECONDS - start)) s)" >&2; done ) &
heartbeat=$!
trap 'kill "$heartbeat" 2>/dev/null || true' EXIT
python3 -m pip install --quiet -e ".[llamacpp]"
python3 -c "import llama_cpp; print('llama.cpp backend installed: llama-cpp-python', llama_cpp.__version__)"
