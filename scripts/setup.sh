#!/usr/bin/env bash
# Create .venv (once) with torch 2.13.0 CPU first, then the shim and its test extras, pinned.
# Usage: bash scripts/setup.sh [constraints-file]   (default: constraints/default.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
constraints=${1:-constraints/default.txt}
venv=${SHIM_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# torch first and exactly 2.13.0, so nothing later pulls a CUDA build.
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e ".[test]" -c "$constraints"
"$venv/bin/python" -c "import torch, transformers, trl; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
