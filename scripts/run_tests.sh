#!/usr/bin/env bash
# The whole test suite: the pure C++ tests (CMake + ctest, when cmake is installed;
# natively, then cross-built for aarch64 and run under qemu) and the Python tests
# (pytest). Exits non-zero on any failure.
# Arguments go to pytest (e.g. `scripts/run_tests.sh -k amsgrad`).
set -euo pipefail
cd "$(dirname "$0")/.."

# The optional test dependencies, so that CI runs the tests that need them: transformers and
# accelerate (tests/test_hf_integration.py), pinned to releases that keep torch 2.13.0
# (setup_venv.sh installs them with the torch pin), matplotlib (the benchmark's plots) and
# pytest-xdist (the Python tests on every core).
bash scripts/setup_venv.sh "transformers==5.17.0" "accelerate==1.15.0" matplotlib pytest-xdist
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

# Most tests are single-threaded Python (the simulated device checks every aten op), so
# they run in parallel, one worker per core up to 4 (more would only add memory);
# PYTEST_WORKERS=0 runs them in this process, one after another.
workers=${PYTEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
echo "== Python tests (pytest, $workers workers)"
"$VENV_BIN/python" -m pytest -q -n "$workers" --dist worksteal tests "$@"
