#!/usr/bin/env bash
# Build llama.cpp's C++ llama-server (with EAGLE-3 speculative support) from the llama-cpp-python sdist on PyPI,
# which vendors llama.cpp (its `vendor/llama.cpp`), and keep its GGUF converter beside it. Cached: a second call
# returns at once. Output: $EAGLE3_CACHE/llama.cpp-$VERSION/{bin/llama-server, bin/llama-eagle3-layer-probe,
# convert_hf_to_gguf.py, conversion/, gguf-py/}. The probe (scripts/llama_layer_probe/) is built in llama.cpp's tree
# and dumps the target hidden states llama.cpp's EAGLE-3 decoder feeds a draft (tests check the layer convention).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${EAGLE3_CACHE:-$HOME/.cache/eagle3-pipeline}"
# "-noamx": built without Intel AMX. On a VM whose CPU advertises AMX but whose kernel does not grant the tile state,
# ggml's AMX matmul dies with SIGILL (seen on a Xeon VM: `tilezero` in tinygemm_kernel_amx, the server's exit code
# -4). AVX-512 and AVX-VNNI stay on through -march=native; explicit -mno-* flags win over -march in GCC.
DEST="$CACHE/llama.cpp-$VERSION-noamx"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PY="${PYTHON:-python3}"
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-eagle3-layer-probe" ] && [ -f "$DEST/conversion/__init__.py" ] && [ -d "$DEST/gguf-py" ]; then
  echo "llama-server cached: $DEST/bin/llama-server"
  exit 0
fi
mkdir -p "$CACHE"
WORK="$(mktemp -d "$CACHE/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
STAGE="$WORK/stage"
mkdir -p "$STAGE/bin"
if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-eagle3-layer-probe" ]; then
  cp "$DEST/bin/"* "$STAGE/bin/"                     # binaries already built: only the converter files were missing
else
  echo "building llama-server $VERSION in $WORK (6-9 minutes on 2 cores, once)"
  cp -r "$HERE/llama_layer_probe" "$SRC/tools/eagle3-layer-probe"
  echo 'add_subdirectory(eagle3-layer-probe)' >> "$SRC/tools/CMakeLists.txt"
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" > "$WORK/cmake.log" 2>&1 \
    || { tail -30 "$WORK/cmake.log"; exit 1; }
  cmake --build "$SRC/build" -j "$(nproc)" --target llama-server llama-eagle3-layer-probe > "$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log"; exit 1; }
  cp "$SRC/build/bin/llama-server" "$SRC/build/bin/llama-eagle3-layer-probe" "$STAGE/bin/"
fi
cp "$SRC/convert_hf_to_gguf.py" "$STAGE/"
cp -r "$SRC/conversion" "$STAGE/conversion"
cp -r "$SRC/gguf-py" "$STAGE/gguf-py"
rm -rf "$DEST" && mv "$STAGE" "$DEST"   # rename last, so a half-built cache is never seen as done
echo "llama-server ready: $DEST/bin/llama-server"
