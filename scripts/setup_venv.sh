#!/usr/bin/env bash
# Creates ./.venv (if missing) with torch 2.13.0, the test tools, and offload_adam
# installed in editable mode. Safe to run again: it only installs what is missing.
# Extra packages can be named as arguments (e.g. `scripts/setup_venv.sh matplotlib`).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
  echo "setup_venv: creating $VENV" >&2
  python3 -m venv "$VENV"
fi

# Pinned torch: a bare `torch` could resolve to a different (or CUDA) build.
want=("torch==2.13.0" ninja pytest hypothesis numpy setuptools "$@")
if ! "$PY" -m pip install -q --disable-pip-version-check "${want[@]}" >/dev/null 2>"$VENV/pip.log"; then
  cat "$VENV/pip.log" >&2
  exit 1
fi

# Editable install of this checkout; --no-build-isolation reuses the venv's
# setuptools instead of fetching one. Skipped when already installed from here
# (checked from another folder, where the checkout itself is not on sys.path).
ROOT="$PWD"
installed_from=$(cd / && "$ROOT/$PY" -c 'import importlib.util as u; s = u.find_spec("offload_adam"); print(s.origin if s else "")' 2>/dev/null || true)
if [[ "$installed_from" != "$ROOT/offload_adam/__init__.py" ]]; then
  if ! "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . >/dev/null 2>"$VENV/pip.log"; then
    cat "$VENV/pip.log" >&2
    exit 1
  fi
fi
