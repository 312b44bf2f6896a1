#!/usr/bin/env bash
# bootstrap.sh -- install missing build packages (apt), then autoreconf,
# configure and make. Idempotent; extra arguments go to configure.
#   BUILD_DIR   where to build (default: build/ in the source tree)
#   JOBS        make -j (default: number of cores)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$src/build}
jobs=${JOBS:-$(nproc)}

need=()
command -v autoreconf >/dev/null || need+=(autoconf)
command -v automake >/dev/null || need+=(automake)
command -v libtoolize >/dev/null || need+=(libtool)
command -v pkg-config >/dev/null || need+=(pkg-config)
pkg-config --exists yaml-0.1 2>/dev/null || need+=(libyaml-dev)
pkg-config --exists libuv 2>/dev/null || need+=(libuv1-dev)
[ -f /usr/include/dlpack/dlpack.h ] || need+=(libdlpack-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "bootstrap: installing ${need[*]}"
  if [ "$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# numpy, for scripts/layer_oracle.py (e2e_smoke.sh's independent check and its
# test): optional, so a failed install only skips those checks.
if ! "$src/scripts/numpy_python.sh" >/dev/null; then
  echo "bootstrap: installing python3-numpy (optional)"
  if [ "$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi
  { DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      python3-numpy >/dev/null 2>&1 ||
    { $sudo apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        python3-numpy >/dev/null 2>&1; }; } ||
    echo "bootstrap: python3-numpy not installed; the layer_oracle.py checks will be skipped"
fi

cd "$src"
if [ ! -x configure ] || [ configure.ac -nt configure ] || [ ! -f build-aux/tap-driver.sh ]; then
  echo "bootstrap: autoreconf"
  autoreconf -fi >/dev/null
  # automake ships the TAP driver; it is not kept in git.
  [ -f build-aux/tap-driver.sh ] || cp "$(ls -d /usr/share/automake-*/tap-driver.sh | tail -n1)" build-aux/
fi
mkdir -p "$build"
cd "$build"
if [ ! -f Makefile ] || [ "$src/configure" -nt Makefile ] || [ $# -gt 0 ]; then
  echo "bootstrap: configure $*"
  "$src/configure" --prefix="$build/install" "$@" >configure.log || { tail -30 configure.log; exit 1; }
  grep -A5 'megamoe [0-9]' configure.log || true
fi
echo "bootstrap: make -j$jobs"
make -j"$jobs" >make.log 2>&1 || { tail -60 make.log; exit 1; }
echo "bootstrap: built in $build"
