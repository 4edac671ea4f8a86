#!/usr/bin/env bash
# Create or update .venv: torch 2.13.0 CPU first, then the shim (editable) and its test extras, pinned.
# Usage: bash scripts/setup.sh [constraints-file]   (default: constraints/default.txt)
#   SHIM_VENV=path     another environment (the matrix builds its cells so)
#   SHIM_COMPILE=0     no bytecode compiled at install (the matrix's doctor-only cells: one process each)
#   SHIM_USE_PIP=1     build with pip instead of uv
#   SHIM_EXCLUDE=names leave these dependencies out (uv's --excludes; a matrix cell whose release
#                      requires a package the index lacks, scripts/matrixlib/cells.py)
#   SHIM_RESOLVE=path  the constraints file names packages without pins: resolve the newest releases of
#                      them (torch included) into path, every package pinned, and build from that (the
#                      matrix's latest cell; uv only); SHIM_RESOLVE_ONLY=1: resolve, write, build nothing
# A constraints file whose first line pins another torch than 2.13.0 (torch==2.15.0: the matrix's torch
# cells) gets that release instead of the CPU build (scripts/_venv.sh, torch_pin); the default never does.
# Built with uv (scripts/_venv.sh). An environment already built from the same constraints,
# pyproject.toml, scripts and pip configuration is left as it is: the command then takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
constraints=${1:-constraints/default.txt}
venv=${SHIM_VENV:-.venv}

summary() {  # one line: what the environment has (the matrix prints a cell's last setup line)
    "$venv/bin/python" -c "import importlib.metadata as m
print(' | '.join(f'{d} {m.version(d)}' for d in ('torch', 'transformers', 'trl', 'peft')))"
}

venv_tool
if [ -n "${SHIM_RESOLVE:-}" ]; then
    resolve_newest "$constraints" "$SHIM_RESOLVE"
    [ "${SHIM_RESOLVE_ONLY:-}" = 1 ] && exit 0  # the pins are all that was asked for
    constraints=$SHIM_RESOLVE
fi
torch_pin "$constraints"
stamp=$(venv_stamp "$constraints" pyproject.toml scripts/setup.sh scripts/_venv.sh scripts/pipconf.py)
if venv_is_current "$venv" "$stamp" && [ "$(_torch_of "$venv")" = "$SHIM_TORCH_BUILD" ]; then
    echo "$venv is up to date: $(summary)"
    exit 0
fi
if [ -n "${SHIM_RESOLVE:-}" ] && [ -x "$venv/bin/python" ] && [ "$(_torch_of "$venv")" != "$SHIM_TORCH_BUILD" ]; then
    rm -rf "$venv"  # the latest cell, and a torch released since it was built: built again from scratch
fi
make_venv "$venv"
lift_torch_cap "$venv"
install_torch "$venv" "$constraints"
venv_excludes "$venv"
venv_install "$venv" -e ".[test]" -c "$constraints" ${EXCLUDE_ARGS[@]+"${EXCLUDE_ARGS[@]}"}
check_torch "$venv"
venv_compile "$venv"
venv_done "$venv" "$stamp"
summary
