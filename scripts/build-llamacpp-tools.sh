#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-bench, llama-speculative, llama-server) from the very source the
# installed llama-cpp-python was built from, with the same flags as scripts/install-llamacpp.sh, so a
# benchmark compares our engine with llama.cpp's on identical kernels. Output: $DEST/bin (default
# ~/.cache/specdecode/llama.cpp-tools/bin). Targets may be named as arguments (default: all three).
# The source gets the same patch as the installed library (scripts/patch_llamacpp.py).
set -euo pipefail
DEST="${DEST:-$HOME/.cache/specdecode/llama.cpp-tools}"
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(llama-bench llama-speculative llama-server)
VERSION="$(python3 -c 'import llama_cpp; print(llama_cpp.__version__)')"
mkdir -p "$DEST/src"
if [ ! -d "$DEST/src/llama_cpp_python-$VERSION" ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST/src"
  tar -xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
fi
python3 "$(dirname "$0")/patch_llamacpp.py" "$DEST/src/llama_cpp_python-$VERSION"
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$DEST/build" --target "${TARGETS[@]}" -j "$(nproc)"
mkdir -p "$DEST/bin"
for t in "${TARGETS[@]}"; do cp "$DEST/build/bin/$t" "$DEST/bin/"; done
echo "built ${TARGETS[*]} (llama-cpp-python $VERSION's llama.cpp) in $DEST/bin"
