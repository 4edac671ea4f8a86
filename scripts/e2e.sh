#!/usr/bin/env bash
# End-to-end tests (tests/e2e): DeepSpeed ZeRO-3 and DDP on two CPU ranks, real trl trainers, shim-run, each
# run with the shim (or one patch) switched off (the bug) and on (the fix). Three environments, each built
# with uv like .venv (scripts/_venv.sh; left as they are while their constraints and the scripts are
# unchanged): .venvs/e2e (constraints/e2e.txt, DeepSpeed 0.19.2 and ray[train] 2.60.0: every test but
# liger's), .venvs/e2e-ds0.19.8
# (constraints/e2e-ds0.19.8.txt, DeepSpeed 0.19.8 on the default stack, where DeepSpeed has its own fixes:
# doctor's verdict on both DeepSpeed patches, ZeRO-3 LoRA training with the patches out of their gate, as
# without checkpointing, and a build labelled 0.19.3+git decided by the probe for the fix); and
# .venvs/e2e-liger (constraints/e2e-liger.txt: the default stack with the real liger-kernel and the
# triton it imports, ~1 GB installed; tests/e2e/test_liger_kernel.py, no DeepSpeed).
# Usage: bash scripts/e2e.sh [pytest args]      (E2E_VENV=path to use another venv for the first one)
#   E2E_ONLY_SETUP=1: build the three environments and run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh

venv_tool
# No bytecode at install (scripts/_venv.sh): the first interpreter of each environment compiles what it
# imports and writes it for the ranks after it, a fraction of compiling torch, DeepSpeed and triton whole.
export SHIM_COMPILE=0
unset PYTHONDONTWRITEBYTECODE

build_cell() {  # build_cell VENV CONSTRAINTS PACKAGE...   (the stack's packages, beside the shim)
    local venv=$1 constraints=$2 stamp
    shift 2
    torch_pin "$constraints"
    stamp=$(venv_stamp "$constraints" pyproject.toml scripts/e2e.sh scripts/_venv.sh scripts/pipconf.py)
    if venv_is_current "$venv" "$stamp" && [ "$(_torch_of "$venv")" = "$SHIM_TORCH_BUILD" ]; then
        return 0
    fi
    make_venv "$venv"
    install_torch "$venv" "$constraints"
    # DeepSpeed is an sdist whose setup imports torch: it is built against the torch installed above
    # (no isolated build environment, which would pull a torch of its own). DS_BUILD_OPS=0: no op is
    # compiled at install; the CPU comm op is JIT-built on first use.
    local isolation=(--no-build-isolation-package deepspeed)
    [ -n "$SHIM_UV" ] || isolation=()  # pip: as before, an isolated build (it downloads a torch for it)
    DS_BUILD_OPS=0 venv_install "$venv" "${isolation[@]}" -e . "$@" \
        trl transformers peft accelerate datasets tokenizers pytest pytest-xdist -c "$constraints"
    check_torch "$venv"
    venv_done "$venv" "$stamp"
}

run_cell() {  # run_cell VENV PYTEST-ARGS...
    local venv=$1
    shift
    "$venv/bin/python" -c "from importlib.metadata import PackageNotFoundError, version
def has(d):
    try:
        return f'{d} {version(d)}'
    except PackageNotFoundError:
        return None
print('e2e:', ' | '.join(filter(None, map(has, ('torch', 'deepspeed', 'liger-kernel', 'transformers', 'trl')))))"
    # The JIT-built op lives with the venv: built once per venv, nothing written to $HOME.
    # -n 0: the runs are two-rank jobs with timeouts of their own, one at a time.
    TORCH_EXTENSIONS_DIR="$(cd "$venv" && pwd)/torch_extensions" \
        timeout -k 30 2400 "$venv/bin/python" -m pytest -m e2e -n 0 "$@"
}

first=${E2E_VENV:-.venvs/e2e}
build_cell "$first" constraints/e2e.txt deepspeed "ray[train]"
build_cell .venvs/e2e-ds0.19.8 constraints/e2e-ds0.19.8.txt deepspeed
build_cell .venvs/e2e-liger constraints/e2e-liger.txt liger-kernel triton
[ "${E2E_ONLY_SETUP:-}" = 1 ] && exit 0
run_cell "$first" tests/e2e --ignore tests/e2e/test_liger_kernel.py "$@"
run_cell .venvs/e2e-ds0.19.8 tests/e2e --ignore tests/e2e/test_liger_kernel.py \
    -k "zero3_doctor_bug_probes or zero3_default_checkpointing_trains or labelled_0_19_3" "$@"
run_cell .venvs/e2e-liger tests/e2e/test_liger_kernel.py "$@"
