#!/usr/bin/env bash
# The end-to-end benchmark (bench/e2e); arguments go to it unchanged.
# Example: scripts/run_bench.sh --help
set -euo pipefail
cd "$(dirname "$0")/.."

# matplotlib draws the plots; the benchmark still prints its tables without it.
bash scripts/setup_venv.sh matplotlib || bash scripts/setup_venv.sh
exec .venv/bin/python -m bench.e2e "$@"
