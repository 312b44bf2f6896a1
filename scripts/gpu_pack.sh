#!/usr/bin/env bash
# gpu_pack.sh -- collects what scripts/gpu_suite.sh runs on a GPU machine
# that lacks this project's build dependencies: test and bench binaries,
# tools, the plugin, libyaml/libuv, the golden vectors.
#   scripts/gpu_pack.sh BUILD_DIR PACK_DIR
set -euo pipefail
build=$(cd "${1:?usage: gpu_pack.sh BUILD_DIR PACK_DIR}" && pwd)
pack=${2:?usage: gpu_pack.sh BUILD_DIR PACK_DIR}
src=$(cd "$(dirname "$0")/.." && pwd)
make -C "$build" -j"$(nproc)" all >/dev/null
make -C "$build" -j"$(nproc)" check TESTS= >/dev/null
make -C "$build" -j"$(nproc)" bench-programs >/dev/null 2>&1 || true
rm -rf "$pack"
mkdir -p "$pack"/{tests,host,plugin/.libs,lib,bench,golden}
real_bin() { # libtool may leave wrappers; prefer the real binary
  local f=$1 d b
  d=$(dirname "$f"); b=$(basename "$f")
  if [ -x "$d/.libs/$b" ]; then echo "$d/.libs/$b"; else echo "$f"; fi
}
for f in "$build"/tests/gpu_test_* "$build"/tests/test_* "$build"/tests/*.sh; do
  [ -x "$f" ] && [ ! -d "$f" ] && case $f in *.log|*.trs|*.o) ;; *) cp "$(real_bin "$f")" "$pack/tests/";; esac
done
for f in "$build"/host/megamoe-*; do
  [ -x "$f" ] && case $f in *.o) ;; *) cp "$(real_bin "$f")" "$pack/host/";; esac
done
for f in "$build"/bench/* "$build"/tests/bench_* "$build"/kernels/bench_*; do
  [ -x "$f" ] && [ -f "$f" ] && case $f in *.o|*.log) ;; *) cp "$(real_bin "$f")" "$pack/bench/";; esac
done
cp "$build/plugin/.libs/libmegamoe_plugin.so" "$pack/plugin/.libs/"
cp /usr/lib/x86_64-linux-gnu/libyaml-0.so.2 /usr/lib/x86_64-linux-gnu/libuv.so.1 "$pack/lib/"
cp "$src"/../shared/golden/*.safetensors "$pack/golden/" 2>/dev/null || true
du -sh "$pack"
