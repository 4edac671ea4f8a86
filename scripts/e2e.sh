#!/usr/bin/env bash
# End-to-end tests (tests/e2e): DeepSpeed ZeRO-3 and DDP on two CPU ranks, real trl trainers, shim-run, each
# run with the shim (or one patch) switched off (the bug) and on (the fix). Two environments, each created
# once: .venvs/e2e (constraints/e2e.txt, DeepSpeed 0.19.2: every test) and .venvs/e2e-ds0.19.3
# (constraints/e2e-ds0.19.3.txt: the ZeRO-3 tests again, where DeepSpeed has its own fixes).
# Usage: bash scripts/e2e.sh [pytest args]      (E2E_VENV=path to use another venv for the first one)
set -euo pipefail
cd "$(dirname "$0")/.."

run_cell() {  # run_cell VENV CONSTRAINTS PYTEST-ARGS...
    local venv=$1 constraints=$2
    shift 2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # torch first and exactly 2.13.0, so nothing later pulls a CUDA build.
    "$venv/bin/python" -m pip install -q torch==2.13.0
    # DS_BUILD_OPS=0: no DeepSpeed op is compiled at install; the CPU comm op is JIT-built on first use.
    DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q -e . \
        deepspeed trl transformers peft accelerate datasets tokenizers pytest -c "$constraints"
    "$venv/bin/python" -c "import deepspeed, torch, transformers, trl; print('e2e: torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
    # The JIT-built op lives with the venv: built once per venv, nothing written to $HOME.
    TORCH_EXTENSIONS_DIR="$(cd "$venv" && pwd)/torch_extensions" \
        timeout -k 30 1500 "$venv/bin/python" -m pytest -m e2e "$@"
}

run_cell "${E2E_VENV:-.venvs/e2e}" constraints/e2e.txt tests/e2e "$@"
run_cell .venvs/e2e-ds0.19.3 constraints/e2e-ds0.19.3.txt tests/e2e -k zero3 "$@"
