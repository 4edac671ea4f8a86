# shellcheck shell=bash
# How the project builds its virtual environments; sourced (from the repository root) by
# scripts/setup.sh, scripts/e2e.sh and scripts/lint.sh.
#
# uv 0.13.8 builds them: it is taken from PATH when that is exactly 0.13.8, else installed once into
# .venvs/_uv (pip install --target, a few seconds). Its cache is .venvs/_uv-cache, on the venvs'
# own filesystem, so every environment hard-links the same files instead of copying them. uv reads
# no pip configuration: scripts/pipconf.py asks pip for it (find-links, indexes, constraints,
# certificate) and passes it on, so uv installs from where pip would. Where uv cannot be had (or
# SHIM_USE_PIP=1), pip does the same work, slower.
#
# torch: 2.13.0, the CPU build, is installed first into each environment and then left alone
# (everything later is resolved around the installed torch); an environment whose torch would not
# be 2.13.0+cpu stops the build before anything is installed, never a CUDA build of several GB.
# Only a constraints file that pins another release exactly (the version matrix's torch cells,
# `torch==2.15.0` on its first line) gets that release, the build PyPI has (on Linux x86_64 a CUDA
# build that runs on the CPU); pip's own cap on torch, if the machine has one, is left out for it.

SHIM_UV_VERSION=0.13.8
SHIM_TORCH_CPU=2.13.0
SHIM_TORCH=torch==$SHIM_TORCH_CPU
SHIM_TORCH_BUILD=$SHIM_TORCH_CPU+cpu

_uv_is_pinned() {  # _uv_is_pinned PATH: is PATH an executable uv of the pinned version?
    [ -n "$1" ] && [ -x "$1" ] && [ "$("$1" --version 2>/dev/null | cut -d' ' -f1-2)" = "uv $SHIM_UV_VERSION" ]
}

_locked() {  # _locked LOCKFILE COMMAND...: run COMMAND holding LOCKFILE (matrix cells build side by side)
    local lock=$1
    shift
    if command -v flock >/dev/null; then
        (flock 9 && "$@") 9>"$lock"
    else
        "$@"
    fi
}

_install_uv() {
    _uv_is_pinned .venvs/_uv/bin/uv && return 0
    rm -rf .venvs/_uv.new
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check \
        --target .venvs/_uv.new "uv==$SHIM_UV_VERSION" && rm -rf .venvs/_uv && mv .venvs/_uv.new .venvs/_uv
}

# venv_tool: find uv (SHIM_UV, empty: pip), read pip's configuration (PIP_UV_ARGS, SHIM_PIPCONF).
venv_tool() {
    SHIM_UV=""
    mkdir -p .venvs
    if [ "${SHIM_USE_PIP:-}" != 1 ]; then
        local found
        found=$(command -v uv 2>/dev/null || true)
        if _uv_is_pinned "$found"; then
            SHIM_UV=$found
        else
            _uv_is_pinned .venvs/_uv/bin/uv || _locked .venvs/.uv.lock _install_uv || true
            if _uv_is_pinned .venvs/_uv/bin/uv; then
                SHIM_UV=$PWD/.venvs/_uv/bin/uv
            else
                echo "uv $SHIM_UV_VERSION could not be installed: building with pip instead" >&2
            fi
        fi
    fi
    SHIM_PIPCONF=$(python3 scripts/pipconf.py)
    PIP_UV_ARGS=()
    eval "$SHIM_PIPCONF"
    export UV_CACHE_DIR="$PWD/.venvs/_uv-cache" UV_LINK_MODE=hardlink UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
}

# venv_stamp FILE...: one line that changes whenever what decides an environment's content does
# (the files given, the tool and its version, pip's configuration, the interpreter).
venv_stamp() {
    {
        cat "$@"
        if [ -n "$SHIM_UV" ]; then echo "uv $SHIM_UV_VERSION"; else echo pip; fi
        echo "compile=${SHIM_COMPILE:-1}"
        [ -z "${SHIM_EXCLUDE:-}" ] || echo "exclude=$SHIM_EXCLUDE"
        echo "$SHIM_PIPCONF"
        python3 -c 'import sys; print(sys.version)'
    } | sha256sum | cut -d' ' -f1
}

# venv_is_current VENV STAMP: VENV exists and was last built to STAMP.
venv_is_current() {
    [ -x "$1/bin/python" ] && [ "$(cat "$1/.shim-stamp" 2>/dev/null)" = "$2" ]
}

venv_done() {  # venv_done VENV STAMP
    echo "$2" >"$1/.shim-stamp"
}

# make_venv VENV: create it (with pip in it: a test builds the wheel with `pip wheel`) unless it has a python.
make_venv() {
    local venv=$1
    [ -x "$venv/bin/python" ] && return 0
    rm -f "$venv/.shim-stamp"
    if [ -n "$SHIM_UV" ]; then
        "$SHIM_UV" venv -q --seed --clear --python "$(python3 -c 'import sys; print(sys.executable)')" "$venv"
    else
        python3 -m venv "$venv"
    fi
}

_compile() {  # _compile YES NO: YES unless SHIM_COMPILE=0
    if [ "${SHIM_COMPILE:-1}" = 0 ]; then echo "$2"; else echo "$1"; fi
}

# venv_install VENV ARGS...: install into VENV with pip's configuration, the bytecode compiled at
# install (SHIM_COMPILE=0: not): where PYTHONDONTWRITEBYTECODE=1 is set, every fresh interpreter
# would otherwise compile transformers again, for each of the suite's many subprocesses.
venv_install() {
    local venv=$1
    shift
    if [ -n "$SHIM_UV" ]; then
        "$SHIM_UV" pip install --python "$venv/bin/python" ${PIP_UV_ARGS[@]+"${PIP_UV_ARGS[@]}"} \
            --index-strategy unsafe-best-match "$(_compile --compile-bytecode --no-compile-bytecode)" "$@"
    else
        "$venv/bin/python" -m pip install -q --disable-pip-version-check "$(_compile --compile --no-compile)" "$@"
    fi
}

# venv_compile VENV: the bytecode of everything in VENV's site-packages (SHIM_COMPILE=0: nothing).
# uv's --compile-bytecode compiles only what that install added (uv 0.13.8), so torch, installed
# first without it, and its dependencies (sympy among them) had none: where PYTHONDONTWRITEBYTECODE=1
# is set, every fresh interpreter compiled them again (`import torch, transformers.modeling_utils`:
# 12.7 CPU-seconds, 6.0 with the bytecode). Files already compiled are skipped; a file this Python
# cannot compile is left as it is, as pip and uv leave it.
venv_compile() {
    [ "${SHIM_COMPILE:-1}" = 0 ] && return 0
    local site
    site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    env -u PYTHONDONTWRITEBYTECODE "$1/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
}

# venv_excludes VENV: SHIM_EXCLUDE's packages (names, space-separated) as uv's --excludes file in
# VENV, in EXCLUDE_ARGS: a matrix cell whose release requires a package the index cannot meet is
# built without it (scripts/matrixlib/cells.py says which and why). pip has no such option.
venv_excludes() {
    EXCLUDE_ARGS=()
    [ -n "${SHIM_EXCLUDE:-}" ] || return 0
    if [ -z "$SHIM_UV" ]; then
        echo "SHIM_EXCLUDE=$SHIM_EXCLUDE needs uv (--excludes); pip cannot leave a dependency out" >&2
        return 1
    fi
    tr ' ' '\n' <<<"$SHIM_EXCLUDE" >"$1/.shim-excludes"
    EXCLUDE_ARGS=(--excludes "$1/.shim-excludes")
}

_torch_of() {  # _torch_of VENV: the installed torch's version, empty if none
    "$1/bin/python" -c 'import importlib.metadata as m
try:
    print(m.version("torch"))
except m.PackageNotFoundError:
    pass'
}

# torch_pin CONSTRAINTS: the torch the environment gets, from the file's `torch==` line, in
# SHIM_TORCH (what to install) and SHIM_TORCH_BUILD (what it must report): torch==2.13.0, or no torch
# line, is the CPU build 2.13.0+cpu; any other exact pin is that release as the index has it.
torch_pin() {
    local line
    line=$(grep -m1 -E '^[[:space:]]*torch[[:space:]]*([=<>!~;]|$)' "$1" | tr -d '[:space:]' || true)
    if [ -z "$line" ] || [ "$line" = "torch==$SHIM_TORCH_CPU" ]; then
        SHIM_TORCH=torch==$SHIM_TORCH_CPU
        SHIM_TORCH_BUILD=$SHIM_TORCH_CPU+cpu
    elif [[ $line =~ ^torch==[0-9]+(\.[0-9]+)*$ ]]; then
        SHIM_TORCH=$line
        SHIM_TORCH_BUILD=${line#torch==}
    else
        echo "$1: torch must be pinned exactly (torch==X.Y.Z), not '$line'" >&2
        return 1
    fi
}

# lift_torch_cap DIR: for an environment pinned to a torch other than the CPU build (a matrix torch
# cell), pip's constraint files are passed on to uv without their torch lines (copies in DIR): a
# machine may cap torch below the cell's exact pin, which the cell asks for on purpose. pip reads
# its configuration itself and cannot be told so: such a build needs uv.
lift_torch_cap() {
    [ "$SHIM_TORCH_BUILD" != "$SHIM_TORCH_CPU+cpu" ] || return 0
    if [ -z "$SHIM_UV" ]; then
        echo "$SHIM_TORCH needs uv: pip would apply its own configuration's constraints on torch" >&2
        return 1
    fi
    local args=() index=0 file copy
    while [ "$index" -lt "${#PIP_UV_ARGS[@]}" ]; do
        if [ "${PIP_UV_ARGS[$index]}" = --constraints ]; then
            file=${PIP_UV_ARGS[$((index + 1))]}
            copy="$1/.shim-pip-constraints-$index.txt"
            grep -v -E '^[[:space:]]*torch[[:space:]]*([=<>!~;]|$)' "$file" >"$copy" || true
            cmp -s "$file" "$copy" || echo "pip's constraint on torch in $file is left out here: $SHIM_TORCH is asked for" >&2
            args+=(--constraints "$copy")
            index=$((index + 2))
        else
            args+=("${PIP_UV_ARGS[$index]}")
            index=$((index + 1))
        fi
    done
    PIP_UV_ARGS=(${args[@]+"${args[@]}"})
}

# resolve_newest REQUIREMENTS OUT: the newest releases the index has for REQUIREMENTS (names, and
# pins for what should not move) and for the shim's test extra, every package pinned, into OUT
# (the version matrix's latest cell; needs uv). torch too: pip's cap on it is left out.
resolve_newest() {
    local requirements=$1 out=$2
    if [ -z "$SHIM_UV" ]; then
        echo "resolving the newest releases needs uv (uv pip compile)" >&2
        return 1
    fi
    mkdir -p "$(dirname "$out")"
    SHIM_TORCH="the newest torch" SHIM_TORCH_BUILD=newest lift_torch_cap "$(dirname "$out")"
    grep -v -E '^[[:space:]]*(#|$)' "$requirements" >"$out.in"
    "$SHIM_UV" pip compile -q --python "$(python3 -c 'import sys; print(sys.executable)')" \
        ${PIP_UV_ARGS[@]+"${PIP_UV_ARGS[@]}"} --index-strategy unsafe-best-match --no-header --no-annotate \
        pyproject.toml --extra test "$out.in" -o "$out.txt"
    # torch first, as in every constraints file (torch_pin reads it; the build installs it first).
    { grep -E '^torch==' "$out.txt"; grep -v -E '^torch==' "$out.txt"; } >"$out"
    rm -f "$out.in" "$out.txt"
}

# install_torch VENV CONSTRAINTS: torch first (torch_pin: 2.13.0, the CPU build, unless the file pins
# another release); stops, having installed nothing, if the torch installed there or the one that
# would be installed is any other build.
install_torch() {
    local venv=$1 constraints=$2 have plan
    have=$(_torch_of "$venv")
    if [ -n "$have" ] && [ "$have" != "$SHIM_TORCH_BUILD" ]; then
        echo "$venv has torch $have, not $SHIM_TORCH_BUILD: remove $venv and run this again" >&2
        return 1
    fi
    [ -n "$have" ] && return 0
    if [ -n "$SHIM_UV" ]; then
        plan=$("$SHIM_UV" pip install --dry-run --python "$venv/bin/python" ${PIP_UV_ARGS[@]+"${PIP_UV_ARGS[@]}"} \
            --index-strategy unsafe-best-match "$SHIM_TORCH" -c "$constraints" 2>&1) || {
            echo "$plan" >&2
            return 1
        }
        if ! grep -q "^ + torch==$SHIM_TORCH_BUILD\$" <<<"$plan"; then
            echo "$plan" >&2
            echo "$SHIM_TORCH would not install the build $SHIM_TORCH_BUILD here (see above), so nothing was" \
                "installed: give pip the folder or index that has it (find-links or extra-index-url in pip's" \
                "configuration; PyTorch's CPU wheels are on its index .../whl/cpu)" >&2
            return 1
        fi
    fi
    # No bytecode yet: venv_compile compiles the whole environment once the rest is installed.
    SHIM_COMPILE=0 venv_install "$venv" "$SHIM_TORCH" -c "$constraints"
}

# check_torch VENV: the torch that imports there is SHIM_TORCH_BUILD (2.13.0+cpu; a release pinned
# by a torch cell may add its build's local tag, e.g. 2.15.0+cu130 for 2.15.0).
check_torch() {
    "$1/bin/python" -W ignore -c "import sys, torch
want, have = '$SHIM_TORCH_BUILD', torch.__version__
sys.exit(None if have == want or ('+' not in want and have.split('+')[0] == want) else
         f'{sys.prefix} has torch {have}, not {want}: remove it and set it up again')"
}
