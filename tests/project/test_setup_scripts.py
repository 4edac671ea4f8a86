"""The scripts that build the environments: pip's configuration reaches uv (scripts/pipconf.py)."""

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.any_version

spec = importlib.util.spec_from_file_location("shim_pipconf", ROOT / "scripts" / "pipconf.py")
pipconf = importlib.util.module_from_spec(spec)
sys.modules["shim_pipconf"] = pipconf
spec.loader.exec_module(pipconf)

# What `pip config list` prints: files' sections and the PIP_* variables (":env:"), values repr'd.
LISTING = """\
:env:.cert='/etc/ssl/ca.pem'
:env:.disable-pip-version-check='1'
:env:.find-links='/srv/wheels'
global.cert='/etc/other.pem'
global.constraint='/etc/pip/constraints.txt'
global.default-timeout='180'
global.extra-index-url='file:///srv/a/simple https://mirror.example/simple'
global.find-links='/srv/old /srv/older'
global.index-url='https://ignored.example/simple'
global.no-index='no'
global.pre='true'
global.trusted_host='mirror.example'
install.index-url='https://index.example/simple'
"""


def test_pip_configuration_becomes_uv_arguments_with_pips_precedence():
    args, env, left = pipconf.uv_settings(pipconf.parse(LISTING))
    assert sorted(zip(args[::2], args[1::2])) == sorted(
        [
            ("--find-links", "/srv/wheels"),  # PIP_FIND_LINKS wins over the files, as in pip
            ("--constraints", "/etc/pip/constraints.txt"),
            ("--extra-index-url", "file:///srv/a/simple"),
            ("--extra-index-url", "https://mirror.example/simple"),
            ("--index-url", "https://index.example/simple"),  # [install] wins over [global]
            ("--allow-insecure-host", "mirror.example"),
        ]
    )
    assert env == {"SSL_CERT_FILE": "/etc/ssl/ca.pem", "UV_HTTP_TIMEOUT": "180"}
    assert left == ["pre"]  # said on stderr: a pip option that changes what installs and is not passed on


def test_no_index_is_passed_on_only_when_pip_has_it_on():
    assert pipconf.uv_settings(pipconf.parse("global.no-index='yes'\n"))[0] == ["--no-index"]
    assert pipconf.uv_settings(pipconf.parse("global.no-index='off'\n"))[0] == []
    assert pipconf.uv_settings(pipconf.parse(""))[:2] == ([], {})


def test_the_bash_it_prints_keeps_spaces_and_quotes():
    text = pipconf.bash(["--find-links", "/a b/it's"], {"SSL_CERT_FILE": "/c d"})
    shown = subprocess.run(
        ["bash", "-c", text + '\nprintf "%s\\n" "${PIP_UV_ARGS[@]}" "$SSL_CERT_FILE"'],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.splitlines() == ["--find-links", "/a b/it's", "/c d"]


def test_it_asks_pip_itself():
    printed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pipconf.py")], capture_output=True, text=True, check=True
    ).stdout
    assert printed.startswith("PIP_UV_ARGS=(")  # whatever this machine's pip has: bash that evaluates
    subprocess.run(["bash", "-euc", printed + '\n: "${PIP_UV_ARGS[@]+x}"'], check=True)


def test_a_cell_built_without_a_dependency_passes_uv_an_excludes_file(tmp_path):
    # scripts/_venv.sh's venv_excludes: SHIM_EXCLUDE's names, one a line, as uv's --excludes file.
    script = f'set -e\nsource "{ROOT}/scripts/_venv.sh"\nvenv_excludes "$1"\nprintf "%s\\n" "${{EXCLUDE_ARGS[@]}}"'
    shown = subprocess.run(
        ["bash", "-c", f"SHIM_UV=uv SHIM_EXCLUDE='kernels other' && {script}", "-", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.splitlines() == ["--excludes", f"{tmp_path}/.shim-excludes"]
    assert (tmp_path / ".shim-excludes").read_text() == "kernels\nother\n"

    # pip cannot leave a dependency out: the build stops instead of installing it.
    refused = subprocess.run(
        ["bash", "-c", f"SHIM_UV= SHIM_EXCLUDE=kernels && {script}", "-", str(tmp_path / "pip")],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "needs uv" in refused.stderr


def venv_sh(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` run by bash after sourcing scripts/_venv.sh, with ``args`` as $1..."""
    return subprocess.run(
        ["bash", "-c", f'set -e\nsource "{ROOT}/scripts/_venv.sh"\n{script}', "-", *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )


@pytest.mark.parametrize(
    "first_line, torch, build",
    [
        ("torch==2.13.0", "torch==2.13.0", "2.13.0+cpu"),  # the default: the CPU build, as ever
        ("# no torch line", "torch==2.13.0", "2.13.0+cpu"),
        ("torch==2.15.0", "torch==2.15.0", "2.15.0"),  # a torch cell: that release, as the index has it
        ("torch == 2.14.1", "torch==2.14.1", "2.14.1"),
    ],
)
def test_an_environment_gets_the_torch_its_constraints_pin(tmp_path, first_line, torch, build):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"{first_line}\ntransformers==5.25.0\ntorchvision==0.29.1\n")
    shown = venv_sh('torch_pin "$1"\necho "$SHIM_TORCH $SHIM_TORCH_BUILD"', str(constraints))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == [torch, build]


@pytest.mark.parametrize("line", ["torch>=2.14", "torch", "torch==2.15.*"])
def test_a_torch_line_that_is_no_exact_pin_stops_the_build(tmp_path, line):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"{line}\n")
    refused = venv_sh('torch_pin "$1"', str(constraints))
    assert refused.returncode == 1 and "torch must be pinned exactly" in refused.stderr


def test_pips_cap_on_torch_is_left_out_only_for_an_environment_that_pins_another_torch(tmp_path):
    """A machine's pip configuration may cap torch (``torch<=2.14.1``); uv gets pip's constraint files
    (scripts/pipconf.py). A torch cell's exact pin must win over that cap, nothing else of the file may
    be lost, and the default build keeps the machine's files as they are."""
    cap = tmp_path / "pip-constraints.txt"
    cap.write_text("torch<=2.14.1\ntorchvision<=0.29.1\nnumpy<3\n")
    script = (
        'PIP_UV_ARGS=(--constraints "$1" --find-links /srv/wheels)\n'
        'SHIM_UV=uv\ntorch_pin "$2"\nlift_torch_cap "$3"\nprintf "%s\\n" "${PIP_UV_ARGS[@]}"'
    )
    for pin, lifted in (("torch==2.13.0", False), ("torch==2.15.0", True)):
        constraints = tmp_path / f"{pin}.txt"
        constraints.write_text(f"{pin}\n")
        out = tmp_path / pin
        out.mkdir()
        shown = venv_sh(script, str(cap), str(constraints), str(out))
        assert shown.returncode == 0, shown.stderr
        args = shown.stdout.splitlines()
        assert args[2:] == ["--find-links", "/srv/wheels"]
        if not lifted:
            assert args[:2] == ["--constraints", str(cap)]
            continue
        assert args[0] == "--constraints" and args[1] != str(cap)
        assert (tmp_path / args[1]).read_text() == "torchvision<=0.29.1\nnumpy<3\n"
        assert f"pip's constraint on torch in {cap} is left out here: torch==2.15.0 is asked for" in shown.stderr

    constraints = tmp_path / "pip.txt"
    constraints.write_text("torch==2.15.0\n")
    refused = venv_sh(script.replace("SHIM_UV=uv", "SHIM_UV="), str(cap), str(constraints), str(tmp_path))
    assert refused.returncode == 1 and "needs uv" in refused.stderr
