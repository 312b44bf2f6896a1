#!/usr/bin/env bash
# stub_layer_create.sh -- builds and runs tests/stub_sm90_layer_create.c: the
# host logic of mm_sm90_layer_create against the reference packing, with the
# CUDA runtime's memory/copy/event calls stubbed (no GPU needed).
#   scripts/stub_layer_create.sh [BUILD_DIR]   (default: build/, already built)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
b=${1:-$src/build}
cuda=${CUDA_HOME:-/usr/local/cuda}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gcc -O1 -std=c11 -D_GNU_SOURCE -include "$b/mm_build_config.h" -I"$src/plugin" -I"$src/kernels" \
  -I"$src/abi" -I"$cuda/include" "$src/tests/stub_sm90_layer_create.c" \
  "$b/kernels/.libs/libmegamoe_kernels.a" "$b/plugin/.libs/libmegamoe_common.a" \
  -Wl,--allow-multiple-definition -L"$cuda/lib64" -lcudart_static -lrt -ldl -lpthread -lstdc++ \
  $(pkg-config --libs libuv yaml-0.1) -lm -o "$out/stub_check"
MEGAMOE_SM90_PACK=host "$out/stub_check"  # the host packing path
