#!/usr/bin/env bash
# Installs llama-cpp-python built for the vector extensions THIS machine can run: the peer that
# tests/ondevice/test_llama_parity.py and `python -m ondevice.bench --suite single` compare with.
#
# Which extensions: .ci/simd_probe.c runs one instruction of each (SSE4.2 ... AVX-512 BF16, AMX) in a forked
# child; an extension is built in only if /proc/cpuinfo lists it AND it ran with the right result. They are
# then named one by one (GGML_NATIVE=OFF): -march=native would turn on whatever cpuid lists, and some virtual
# machines list AMX tiles they cannot run, where such a build segfaults at its first decode.
#
# Before a wheel is cached, a child process decodes a tiny GGUF with it (`python -m ondevice.peer
# verify-wheel`); a wheel that crashes there is never cached, and the script ends with one line saying why.
# If an AMX build fails that check, the wheel is built once more without AMX. After installing, the same
# decode runs against the installed package.
#
# The wheel is cached in $PRISM_WHEEL_CACHE (default ~/.cache/prismllm/wheels) under a key made of the
# llama-cpp-python version, the CMake flags (so the extensions that ran) and the Python version. On a miss
# it is built from the sdist: ~7 min on 2 shared cores, then every later run installs it in seconds.
# Build-time cuts that change no kernel: no tools/examples/tests/server/app, no multimodal (LLAVA) library,
# no OpenSSL, and no libllama-common (the Python bindings never load it; llama-cpp-python forces it on, so
# the sdist's CMakeLists is patched).
#
#   .ci/llama_cpp_wheel.sh                 # probe, build or reuse, check, install
#   .ci/llama_cpp_wheel.sh --print-flags   # the probe's verdicts and the CMake flags, nothing else
#   PRISM_LLAMA_NO_BUILD=1 ...             # never build: a cache miss (or a cached wheel that fails) is an error
set -euo pipefail
VER=0.3.36
PY=${PYTHON:-python3}
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${PRISM_WHEEL_CACHE:-$HOME/.cache/prismllm/wheels}"
CUTS="-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
-DLLAMA_BUILD_APP=OFF -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF"
die() { echo "error: $*" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ---- the vector extensions that run here -> GGML_* flags
simd_flags() {  # $1: "noamx" leaves AMX out
  if [ "$(uname -m)" != "x86_64" ]; then
    echo "-DGGML_NATIVE=ON"  # ARM: ggml checks each feature with a test compile against the native target
    return
  fi
  local cpu probe
  # PRISM_CPU_FLAGS stands in for /proc/cpuinfo's flag line (tests: a machine that lists AMX it cannot run)
  cpu=" ${PRISM_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)} "
  ${CC:-cc} -O1 -o "$work/simd_probe" "$HERE/simd_probe.c" || die "cannot compile .ci/simd_probe.c (needs gcc >= 11 or clang >= 12)"
  probe=$("$work/simd_probe")
  echo "$probe" | sed 's/^/  simd probe: /' >&2
  local out="-DGGML_NATIVE=OFF" name listed ran
  # name : the cpuinfo flags that must all be listed
  for pair in SSE42:sse4_2 AVX:avx AVX2:avx2 FMA:fma F16C:f16c BMI2:bmi2 AVX_VNNI:avx_vnni \
              AVX512:avx512f,avx512cd,avx512vl,avx512dq,avx512bw AVX512_VBMI:avx512vbmi \
              AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16 AMX_TILE:amx_tile AMX_INT8:amx_int8 AMX_BF16:amx_bf16; do
    name=${pair%%:*}
    listed=1
    for f in $(echo "${pair#*:}" | tr ',' ' '); do
      [[ "$cpu" == *" $f "* ]] || listed=0
    done
    ran=0
    echo "$probe" | grep -qx "$name ok" && ran=1
    if [ "$listed" = 1 ] && [ "$ran" = 1 ] && ! { [ "${1:-}" = noamx ] && [[ "$name" == AMX_* ]]; }; then
      out="$out -DGGML_$name=ON"
    else
      out="$out -DGGML_$name=OFF"
    fi
  done
  echo "$out"
}

cache_dir() {  # $1: the full CMake flags
  local key
  key=$(printf '%s\n' "$VER" "$1" "no-common" "$($PY -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
  echo "$CACHE/llama-cpp-python-$VER-$key"
}

build() {  # $1: CMake flags, $2: output folder
  local src="$work/llama_cpp_python-$VER"
  if [ ! -d "$src" ]; then
    $PY -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$work/sdist"
    tar xzf "$work/sdist/llama_cpp_python-$VER.tar.gz" -C "$work"
    sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE BOOL/set(LLAMA_BUILD_COMMON OFF CACHE BOOL/' "$src/CMakeLists.txt"
    grep -q 'set(LLAMA_BUILD_COMMON OFF CACHE BOOL' "$src/CMakeLists.txt" || die "patching llama-cpp-python's CMakeLists failed"
  fi
  rm -rf "$src/build" "$2"
  local start
  start=$(date +%s)
  echo "llama-cpp-python $VER: building with $1 (several minutes)" >&2
  CMAKE_ARGS="$1" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $PY -m pip wheel -q --no-deps -w "$2" "$src"
  echo "built in $(( $(date +%s) - start )) s on $(nproc) cores, $(date -Iminutes); flags: $1" > "$2/BUILD_INFO"
}

verify() {  # $1: wheel file; prints the one-line verdict, returns non-zero if the wheel cannot decode
  # its runtime dependencies first (numpy, diskcache, jinja2, typing-extensions), as installing it would
  local deps
  deps=$($PY - "$1" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
  meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
  for ln in z.read(meta).decode().splitlines():
    if ln.startswith("Requires-Dist:") and "extra ==" not in ln:
      print(ln.split(":", 1)[1].strip())
PYEOF
  ) || { echo "error: $1 is not a readable wheel" >&2; return 1; }
  [ -z "$deps" ] || echo "$deps" | tr '\n' '\0' | xargs -0 $PY -m pip install -q
  $PY -m ondevice.peer verify-wheel "$1"
}

FLAGS="$(simd_flags) $CUTS"
if [ "${1:-}" = "--print-flags" ]; then
  echo "$FLAGS"
  echo "cache: $(cache_dir "$FLAGS")"
  exit 0
fi

DIR=$(cache_dir "$FLAGS")
wheel() { ls "$1"/llama_cpp_python-$VER-*.whl 2>/dev/null | head -1; }
if [ -n "$(wheel "$DIR")" ] && ! verify "$(wheel "$DIR")"; then
  echo "the cached wheel in $DIR failed its smoke decode: removing it" >&2
  rm -rf "$DIR"
fi
if [ -z "$(wheel "$DIR")" ]; then
  [ "${PRISM_LLAMA_NO_BUILD:-0}" = 1 ] && die "no working llama-cpp-python $VER wheel in $DIR and PRISM_LLAMA_NO_BUILD=1; unset it to build one"
  build "$FLAGS" "$work/wheel"
  if ! verify "$(wheel "$work/wheel")"; then
    if [[ "$FLAGS" == *"GGML_AMX_TILE=ON"* ]]; then
      echo "the AMX build failed its smoke decode: building once more without AMX" >&2
      FLAGS="$(simd_flags noamx) $CUTS"
      DIR=$(cache_dir "$FLAGS")
      build "$FLAGS" "$work/wheel"
      verify "$(wheel "$work/wheel")" || die "llama-cpp-python $VER built with $FLAGS crashes or fails in a tiny decode (above); not cached"
    else
      die "llama-cpp-python $VER built with $FLAGS crashes or fails in a tiny decode (above); not cached"
    fi
  fi
  mkdir -p "$DIR"
  cp "$work"/wheel/llama_cpp_python-$VER-*.whl "$work/wheel/BUILD_INFO" "$DIR/"
fi
$PY -m pip install -q "$(wheel "$DIR")"  # with its dependencies
$PY -m pip install -q --force-reinstall --no-deps "$(wheel "$DIR")"  # this build, even over the same version
# The installed package, checked the same way: a child decodes a tiny model (not just an import).
$PY -m ondevice.peer smoke
