#!/usr/bin/env bash
# Installs llama-cpp-python built for THIS machine's CPU (GGML_NATIVE=ON: AVX-512/VNNI where present), the
# peer that tests/ondevice/test_llama_parity.py and `python -m ondevice.bench --suite single` compare with.
#
# The wheel is cached in $PRISM_WHEEL_CACHE (default ~/.cache/prismllm/wheels) under a key made of the
# llama-cpp-python version, the CMake flags, the CPU's flag line and the Python version, so a machine of
# another kind never loads a build for instructions it lacks. On a miss it is built from the sdist: ~7 min
# on 2 shared cores (ondevice/README.md, 'llama.cpp peer'), then every later run installs it in seconds.
# Build-time cuts that change no kernel: no tools/examples/tests/server/app, no multimodal (LLAVA) library,
# no OpenSSL, and no libllama-common (the Python bindings never load it; llama-cpp-python forces it on, so
# the sdist's CMakeLists is patched). AMX is off explicitly: hosts without AMX must never get its path.
set -euo pipefail
VER=0.3.36
PY=${PYTHON:-python3}
CACHE="${PRISM_WHEEL_CACHE:-$HOME/.cache/prismllm/wheels}"
FLAGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAVA_BUILD=OFF \
-DLLAMA_OPENSSL=OFF"
KEY=$(printf '%s\n' "$VER" "$FLAGS" "no-common" "$(grep -m1 '^flags' /proc/cpuinfo)" \
      "$($PY -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
DIR="$CACHE/llama-cpp-python-$VER-$KEY"

if ! ls "$DIR"/llama_cpp_python-$VER-*.whl >/dev/null 2>&1; then
  echo "llama-cpp-python $VER: no cached native wheel in $DIR; building it (several minutes)" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  $PY -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$tmp"
  tar xzf "$tmp/llama_cpp_python-$VER.tar.gz" -C "$tmp"
  src="$tmp/llama_cpp_python-$VER"
  sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE BOOL/set(LLAMA_BUILD_COMMON OFF CACHE BOOL/' "$src/CMakeLists.txt"
  grep -q 'set(LLAMA_BUILD_COMMON OFF CACHE BOOL' "$src/CMakeLists.txt" || { echo "patch failed" >&2; exit 1; }
  start=$(date +%s)
  CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $PY -m pip wheel -q --no-deps -w "$tmp/wheel" "$src"
  mkdir -p "$DIR"
  cp "$tmp"/wheel/llama_cpp_python-$VER-*.whl "$DIR/"
  echo "built in $(( $(date +%s) - start )) s on $(nproc) cores, $(date -Iminutes)" > "$DIR/BUILD_INFO"
fi
$PY -m pip install -q --find-links "$DIR" --prefer-binary "llama-cpp-python==$VER"
# Smoke test: the library loads and was built with this CPU's vector extensions.
$PY - <<'EOF'
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
print(f"llama-cpp-python {llama_cpp.__version__}: {info.strip()}")
assert "AVX2 = 1" in info or "NEON = 1" in info, "llama.cpp was not built for this CPU"
EOF
