#!/usr/bin/env bash
# Install the llama.cpp backend (`--backend llamacpp`): llama-cpp-python, built from source here.
# Its version is pinned in pyproject.toml (extra "llamacpp"); its build flags live in this file only.
#   -DGGML_NATIVE=ON   kernels for this machine's CPU (AVX2 / AVX512 / AVX512-BF16 / AMX as present)
#   -DLLAVA_BUILD=OFF  no multimodal library (not used), a shorter build
#   -DLLAMA_CURL=OFF   no downloads from llama.cpp itself
# The source is patched first (scripts/patch_llamacpp.py: without it the AMX kernels fault with GCC 12 on
# Intel CPUs that have AMX). The wheel is kept in $SPECDECODE_CACHE/wheels (default ~/.cache/specdecode),
# named by version, patch and flags, so a second run installs it in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_ARGS="${SPECDECODE_LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
VERSION="$(sed -n 's/^llamacpp = \["llama-cpp-python==\([0-9.]*\)"\]$/\1/p' pyproject.toml)"
[ -n "$VERSION" ] || { echo "install-llamacpp: no llama-cpp-python pin found in pyproject.toml" >&2; exit 1; }
CACHE="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}"
KEY="$(cat scripts/patch_llamacpp.py <(echo "$CMAKE_ARGS") <(uname -m) <(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) \
       | sha256sum | cut -c1-12)"
WHEELS="$CACHE/wheels/llama-cpp-python-$VERSION-$KEY"
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "installing the llama.cpp backend: llama-cpp-python $VERSION built from source once, 10–20 minutes on 2 cores" \
       "(later runs reuse the wheel in $WHEELS)" >&2
  work="$(mktemp -d)"
  heartbeat=""
  # (the heartbeat is usually gone by now: a failed kill must not become the script's exit status under set -e)
  trap 'if [ -n "$heartbeat" ]; then kill "$heartbeat" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
  tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
  python3 scripts/patch_llamacpp.py "$work/llama_cpp_python-$VERSION"
  ( start=$SECONDS; while sleep 10; do echo "  ... still building llama-cpp-python ($((SECONDS - start)) s)" >&2; done ) &
  heartbeat=$!
  python3 -m pip wheel --quiet --no-deps "$work/llama_cpp_python-$VERSION" -w "$work/wheel"
  kill "$heartbeat" 2>/dev/null || true
  mkdir -p "$WHEELS"
  cp "$work"/wheel/llama_cpp_python-*.whl "$WHEELS/"
fi
python3 -m pip install --quiet --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl
python3 -m pip install --quiet -e ".[llamacpp]"   # its dependencies; the pin is now satisfied
python3 -c "import llama_cpp; print('llama.cpp backend installed: llama-cpp-python', llama_cpp.__version__)"
