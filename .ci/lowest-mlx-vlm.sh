#!/usr/bin/env bash
# The tests that exercise mlx-vlm, at the lowest mlx-vlm of the package's range.
#
# pyproject.toml's [server] extra takes mlx-vlm as a range (mlx-vlm>=LOW,<HIGH);
# the main environment has the newest release (the whole suite runs there).
# This runs the engine, the families, batching, text models and the tiny
# models (written and loaded by the lowest release, in a cache of their own)
# with mlx-vlm LOW: batched == solo against that release's own
# stream_generate, seeds, disconnects. Not the end-to-end tests (33 s): they
# check the same engine through HTTP, and the HTTP side does not depend on
# mlx-vlm's release; pass tests/server/test_e2e.py as an argument to add them.
#
# The environment is the main one with mlx-vlm LOW put in front of it: a venv
# whose site-packages holds only mlx-vlm (installed without dependencies) and
# a .pth file that adds the main environment's site-packages after it. Every
# other package is the main environment's, so the difference is mlx-vlm alone
# and the install is one wheel; `pip check` then checks LOW's requirements
# against them.
#
# Usage: .ci/lowest-mlx-vlm.sh [VENV] [PYTEST ARGS...]
#   VENV         the environment (default: $LOWEST_VENV, else .venv-lowest-mlx-vlm);
#                created if missing, reused if present.
#   MAIN_PYTHON  python of the main environment, where mlx-pinned is installed
#                with its [test] extra (default: .venv/bin/python).
# Needs the package index once (the mlx-vlm wheel); the tests are offline.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${1:-${LOWEST_VENV:-.venv-lowest-mlx-vlm}}"
[ "$#" -gt 0 ] && shift
MAIN_PYTHON="${MAIN_PYTHON:-.venv/bin/python}"
VPY="$VENV/bin/python"

step() { printf '\n== %s\n' "$*"; }
started=$SECONDS

# The range's lower bound, from pyproject.toml.
LOW="$("$MAIN_PYTHON" - <<'EOF'
import re
from pathlib import Path

from packaging.requirements import Requirement

[line] = re.findall(r'"(mlx-vlm\b[^"]*)"', Path("pyproject.toml").read_text())
lows = [s.version for s in Requirement(line).specifier if s.operator == ">="]
assert len(lows) == 1, f"mlx-vlm is no range with one lower bound: {line}"
print(lows[0])
EOF
)"

if [ ! -x "$VPY" ]; then
    step "creating $VENV on top of $MAIN_PYTHON's environment"
    "$MAIN_PYTHON" -m venv "$VENV"
    main_lib="$("$MAIN_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    own_lib="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$main_lib" >"$own_lib/mlx-pinned-main-environment.pth"
fi

step "installing mlx-vlm $LOW (without dependencies: the main environment's)"
"$VPY" -m pip install --quiet --disable-pip-version-check --no-deps "mlx-vlm==$LOW"
"$VPY" -m pip check --disable-pip-version-check
"$VPY" - "$LOW" <<'EOF'
import importlib.metadata as md
import sys

import mlx_vlm

assert md.version("mlx-vlm") == sys.argv[1], md.version("mlx-vlm")
assert mlx_vlm.__file__.startswith(sys.prefix), mlx_vlm.__file__  # not the main one
for dist in ("mlx", "mlx-vlm", "transformers"):
    print(f"{dist} {md.version(dist)}")
EOF
echo "ready in $((SECONDS - started)) s"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The tiny models written by this mlx-vlm, not the main environment's.
export MLX_PINNED_CACHE="$VENV/tiny-models"

step "pytest at mlx-vlm $LOW"
"$VPY" -m pytest -q -p no:cacheprovider \
    tests/server/test_engine.py \
    tests/server/test_families.py \
    tests/server/test_batching.py \
    tests/server/test_text_models.py \
    tests/server/test_mlx_vlm_range.py \
    tests/test_testing.py \
    "$@"
echo "lowest mlx-vlm step: $((SECONDS - started)) s"
