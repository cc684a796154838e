#!/usr/bin/env bash
# The pure C++ kernels and their tests built for aarch64 with a cross compiler
# and run under user-mode emulation (qemu-aarch64), so the NEON variant is tested
# on an x86 machine: every variant against the scalar one bit for bit and against
# float64, the 16-bit conversions, OFFLOAD_ADAM_ISA (ctest, as in the native build).
# The emulated CPU is a Cortex-A53 (ARMv8.0-A): any instruction beyond the
# AArch64 baseline would stop the tests with SIGILL.
#
# Needs aarch64-linux-gnu-g++ and qemu-aarch64 (Debian: g++-aarch64-linux-gnu,
# qemu-user); installs them with apt-get when missing. Where they cannot be had
# (not root, no apt-get, no network) it says so and exits 0: a skip, not a pass.
# Called by scripts/run_tests.sh; a couple of minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

CXX_AARCH64=${CXX_AARCH64:-aarch64-linux-gnu-g++}   # another cross g++ may be named here
SYSROOT=/usr/aarch64-linux-gnu   # the cross toolchain's libc and libstdc++, for qemu's loader
BUILD=build/aarch64

have_tools() { command -v "$CXX_AARCH64" >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; }
skip() { echo "== aarch64 cross tests SKIPPED: $*" >&2; exit 0; }

if ! have_tools; then
  command -v cmake >/dev/null 2>&1 || skip "cmake not found"
  command -v apt-get >/dev/null 2>&1 || skip "$CXX_AARCH64 or qemu-aarch64 missing and no apt-get to install them"
  SUDO=()
  if [[ $(id -u) -ne 0 ]]; then
    sudo -n true 2>/dev/null || skip "$CXX_AARCH64 or qemu-aarch64 missing; installing needs root: apt-get install g++-aarch64-linux-gnu qemu-user"
    SUDO=(sudo -n)
  fi
  echo "== installing the aarch64 cross compiler and qemu-user (apt-get)" >&2
  log=$(mktemp)
  # Another apt-get may hold the lock for a while: wait for it rather than fail.
  apt_get=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -q -y)
  if ! { "${apt_get[@]}" install --no-install-recommends g++-aarch64-linux-gnu qemu-user >"$log" 2>&1 ||
         { "${apt_get[@]}" update >>"$log" 2>&1 &&
           "${apt_get[@]}" install --no-install-recommends g++-aarch64-linux-gnu qemu-user >>"$log" 2>&1; }; }; then
    tail -n 5 "$log" >&2
    rm -f "$log"
    skip "apt-get could not install g++-aarch64-linux-gnu qemu-user (see above)"
  fi
  rm -f "$log"
  have_tools || skip "installed, but $CXX_AARCH64 or qemu-aarch64 is still not on PATH"
fi

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
echo "== aarch64 C++ tests (cross build, run under qemu-aarch64 -cpu cortex-a53)"
start=$SECONDS
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER="$CXX_AARCH64" \
  "-DCMAKE_CROSSCOMPILING_EMULATOR=qemu-aarch64;-cpu;cortex-a53;-L;$SYSROOT" >/dev/null
cmake --build "$BUILD"
ctest --test-dir "$BUILD" --output-on-failure
echo "== aarch64 cross tests: $((SECONDS - start)) s"
