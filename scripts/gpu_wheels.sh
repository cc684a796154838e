#!/usr/bin/env bash
# Downloads the optional peers of the GPU check (torchao) as wheels into .whl/
# (ignored by git), for the lent GPU machine, which can fetch nothing: its image
# has torch 2.11 on Python 3.12. Run here, then carry .whl with scripts/gpu_check.sh.
#   TORCHAO_VERSION=0.16.0 bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "torchao==${TORCHAO_VERSION:-0.16.0}"
ls -l .whl
