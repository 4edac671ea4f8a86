#!/usr/bin/env bash
# ruff (lint and format check) and mypy (strict on shim/), configured in pyproject.toml, with the
# pinned linters of constraints/lint.txt installed into .venv (with uv, as scripts/setup.sh does;
# a second or so when they are there). .ci/run runs this before the tests.
# Usage: bash scripts/lint.sh        (after bash scripts/setup.sh; SHIM_VENV=path for another venv)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
venv=${SHIM_VENV:-.venv}
venv_tool
SHIM_COMPILE=0 venv_install "$venv" -q -r constraints/lint.txt
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
