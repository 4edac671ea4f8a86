#!/usr/bin/env bash
# End-to-end tests (tests/e2e): DeepSpeed ZeRO-3 on two CPU ranks and real trl trainers, each run with the
# shim switched off (the bug) and on (the fix). Own venv, created once: .venvs/e2e (constraints/e2e.txt).
# Usage: bash scripts/e2e.sh [pytest args]      (E2E_VENV=path to use another venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${E2E_VENV:-.venvs/e2e}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# torch first and exactly 2.13.0, so nothing later pulls a CUDA build.
"$venv/bin/python" -m pip install -q torch==2.13.0
# DS_BUILD_OPS=0: no DeepSpeed op is compiled at install; the CPU comm op is JIT-built on first use.
DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q -e . \
    deepspeed trl transformers peft accelerate datasets tokenizers pytest -c constraints/e2e.txt
"$venv/bin/python" -c "import deepspeed, torch, transformers, trl; print('e2e: torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
# The JIT-built op lives with the venv: built once per venv, nothing written to $HOME.
export TORCH_EXTENSIONS_DIR="$(cd "$venv" && pwd)/torch_extensions"
timeout -k 30 1200 "$venv/bin/python" -m pytest -m e2e tests/e2e "$@"
