#!/usr/bin/env bash
# The whole test suite: the pure C++ tests (CMake + ctest, when cmake is installed;
# natively, then cross-built for aarch64 and run under qemu) and the Python tests
# (pytest). Exits non-zero on any failure.
# Arguments go to pytest (e.g. `scripts/run_tests.sh -k amsgrad`).
set -euo pipefail
cd "$(dirname "$0")/.."

# The optional test dependencies, so that CI runs the tests that need them: transformers and
# accelerate (tests/test_hf_integration.py), pinned to releases that keep torch 2.13.0
# (setup_venv.sh installs them with the torch pin), and matplotlib (the benchmark's plots).
bash scripts/setup_venv.sh "transformers==5.17.0" "accelerate==1.15.0" matplotlib
VENV_BIN="$PWD/.venv/bin"
export PATH="$VENV_BIN:$PATH"   # ninja from the venv, for CMake and the JIT build

if command -v cmake >/dev/null 2>&1; then
  echo "== C++ tests (cmake + ctest)"
  cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_MAKE_PROGRAM="$(command -v ninja)" >/dev/null
  cmake --build build/cpp
  ctest --test-dir build/cpp --output-on-failure
  # The same C++ tests built for aarch64 and run under qemu (the NEON variant).
  bash scripts/cross_test_aarch64.sh
else
  echo "== C++ tests skipped: cmake not found (apt-get install cmake)" >&2
fi

echo "== Python tests (pytest)"
"$VENV_BIN/python" -m pytest -q tests "$@"
