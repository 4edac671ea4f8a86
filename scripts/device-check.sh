#!/usr/bin/env bash
# The device check: on a CUDA machine, the tests that run on the test device (marker on_device: the
# do-no-harm workflows, each patch's off-vs-on gradient tests, the compile tests, inductor and bf16
# autocast included) with --device cuda, then the memory benchmark (benchmarks/checkpoint_memory.py),
# inside 8 minutes; one report (results, versions, device) in REPORT_DIR. docs/testing.md says more.
#
# Usage:
#   bash scripts/device-check.sh [REPORT_DIR]           on a CUDA machine (REPORT_DIR: device-report)
#   bash scripts/device-check.sh --smoke [REPORT_DIR]   on this machine's CPU: the same steps on a small
#                                                       subset and the benchmark's --quick run (the suite
#                                                       runs it: tests/project/test_device_check.py)
#   bash scripts/device-check.sh --fetch [WHEEL_DIR]    here, with a package registry: download the wheels
#                                                       (Python 3.12, x86-64) a CUDA machine without internet
#                                                       lacks, at the default cell's pins (WHEEL_DIR: .whl)
# A relative REPORT_DIR, WHEEL_DIR or WHEELS is taken from the folder the script is started in.
# Environment:
#   PYTHON       the interpreter holding torch (python3; --smoke: .venv/bin/python, which
#                scripts/setup.sh makes: without it --smoke says so and exits 2)
#   WHEELS       a folder of wheels installed before the shim, without an index (.whl; none when absent)
#   DEVICE_VENV  where the check's environment is built (a temporary folder)
#
# It never changes PYTHON's environment: it builds one of its own that sees PYTHON's packages (torch
# with CUDA) behind its own (the wheels, the shim installed editable, as scripts/setup.sh does).
set -uo pipefail
caller=$(pwd)  # a relative folder given on the command line, or in WHEELS, is the caller's
cd "$(dirname "$0")/.."

given() {  # given PATH: PATH as the caller meant it, relative to the folder the script was started in
    case "$1" in
    /*) echo "$1" ;;
    *) echo "$caller/$1" ;;
    esac
}

#: What the CUDA image lacks or holds at another release than the default cell (per the device
#: machine's package list): their pins are read from constraints/default.txt. About 28 MB of wheels;
#: pyarrow (55 MB) is left to the image.
DEVICE_WHEELS=(transformers trl peft accelerate datasets huggingface_hub kernels tokenizers wrapt
    httpx2 httpcore2 truststore idna dill multiprocess tomlkit hf-xet click fsspec)
TEST_LIMIT=300   # seconds for the tests, and for the benchmark: 8 minutes with the set-up
BENCH_LIMIT=120

pin_of() {  # pin_of NAME: NAME==VERSION from constraints/default.txt (names compared as pip does)
    local wanted
    wanted=$(echo "$1" | tr '_.' '--' | tr '[:upper:]' '[:lower:]')
    while IFS= read -r line; do
        line=${line%%#*}
        local name=${line%%==*}
        [ "$(echo "$name" | tr '_.' '--' | tr '[:upper:]' '[:lower:]')" = "$wanted" ] && { echo "$line"; return 0; }
    done <constraints/default.txt
    echo "device-check: $1 is not pinned in constraints/default.txt" >&2
    return 1
}

if [ "${1:-}" = "--fetch" ]; then
    folder=.whl
    [ -n "${2:-}" ] && folder=$(given "$2")
    mkdir -p "$folder"
    pins=()
    for name in "${DEVICE_WHEELS[@]}"; do
        pin=$(pin_of "$name") || exit 1
        pins+=("$pin")
    done
    platforms=()
    for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
        manylinux1_x86_64; do
        platforms+=(--platform "$platform")
    done
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$folder" "${pins[@]}"
fi

mode=device
if [ "${1:-}" = "--smoke" ]; then
    mode=smoke
    shift
    if [ -z "${PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then  # a clean clone: nothing to run it on yet
        echo "device-check: --smoke runs on .venv/bin/python, which is not there: run bash scripts/setup.sh" \
            "first (or set PYTHON to an interpreter that has torch)" >&2
        exit 2
    fi
fi
report=device-report
[ -n "${1:-}" ] && report=$(given "$1")
mkdir -p "$report"
report=$(cd "$report" && pwd)
root=$(pwd)
if [ "$mode" = smoke ]; then
    device=cpu
    python=${PYTHON:-.venv/bin/python}
    tests=(tests/patches/test_checkpointing_gradients.py -n 0)  # two tests on the device fixture
    bench=(--quick)
else
    device=cuda
    python=${PYTHON:-python3}
    tests=(tests -n 4 --dist load)  # every test marked on_device, one file's tests on several workers
    bench=()
fi
wheels=.whl
[ -n "${WHEELS:-}" ] && wheels=$(given "$WHEELS")
if [ -n "${DEVICE_VENV:-}" ]; then
    venv=$DEVICE_VENV
else
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    venv=$scratch/venv
fi
steps=()
status=0

step() {  # step NAME LOG COMMAND...: run COMMAND, its output to LOG; note its exit status and time
    local name=$1 log=$2 start=$SECONDS code
    shift 2
    echo "=== device-check: $name" >&2
    "$@" >"$log" 2>&1
    code=$?
    steps+=("| $name | $code$([ "$code" = 124 ] && echo ' (timed out)') | $((SECONDS - start)) s |")
    [ "$code" = 0 ] || status=1
    return "$code"
}

install() {  # the check's environment: a venv that sees PYTHON's packages behind its own
    "$python" -m venv --without-pip "$venv" || return 1
    local own
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || return 1
    # PYTHON's package folders, each through addsitedir, not as a bare path: their .pth files
    # (editable installs, torch's) are read too
    "$python" -c 'import site, sys
for path in sys.path:
    if path.endswith(("site-packages", "dist-packages")):
        print(f"import site; site.addsitedir({path!r})")' >"$own/_device_check_base.pth" || return 1
    cat "$own/_device_check_base.pth"
    local pip=("$venv/bin/python" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check)
    if compgen -G "$wheels/*.whl" >/dev/null; then
        "${pip[@]}" "$wheels"/*.whl || return 1
    else
        echo "no wheels in $wheels: PYTHON's packages as they are"
    fi
    "${pip[@]}" --no-build-isolation -e "$root"
}

versions() {
    "$venv/bin/python" - "$device" <<'EOF'
import importlib.metadata as metadata
import platform
import sys

import torch

print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
if sys.argv[1] == "cuda" and torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")
else:
    print(f"device: CPU ({platform.processor() or platform.machine()}), CUDA available: {torch.cuda.is_available()}")
for name in ("transformers", "trl", "peft", "accelerate", "datasets", "triton", "wrapt", "pytest", "hf-train-shim"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}: not installed")
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    return 0
}

started=$SECONDS
step install "$report/install.log" install
if [ "$status" = 0 ]; then
    step tests "$report/pytest.log" timeout "$TEST_LIMIT" "$venv/bin/python" -m pytest -p no:cacheprovider \
        --device "$device" -m "on_device and not e2e" -q -rfEs --junitxml "$report/junit.xml" "${tests[@]}"
    step memory "$report/memory.log" timeout "$BENCH_LIMIT" "$venv/bin/python" benchmarks/checkpoint_memory.py \
        --device "$device" --json "$report/memory.json" ${bench[@]+"${bench[@]}"}
fi

{
    echo "# hf-train-shim device check ($mode, --device $device)"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
        "$((SECONDS - started)) s in all; verdict: $([ "$status" = 0 ] && echo passed || echo FAILED)"
    echo
    echo '```'
    [ -x "$venv/bin/python" ] && versions 2>&1
    echo '```'
    echo
    echo "| step | exit | time |"
    echo "|---|---|---|"
    printf '%s\n' "${steps[@]}"
    if [ -f "$report/pytest.log" ]; then
        echo
        echo "## Tests (pytest.log, junit.xml)"
        echo
        echo '```'
        grep -E '^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)|no tests ran' "$report/pytest.log" | tail -40
        echo '```'
    fi
    if [ -f "$report/memory.log" ]; then
        echo
        echo "## What checkpointing saves (memory.log, memory.json)"
        echo
        echo '```'
        grep -v '^  measuring ' "$report/memory.log"
        echo '```'
    fi
    if [ "$status" != 0 ] && [ -f "$report/install.log" ]; then
        echo
        echo "## install.log (end)"
        echo '```'
        tail -20 "$report/install.log"
        echo '```'
    fi
} >"$report/report.md"
cat "$report/report.md"
exit "$status"
