import importlib.machinery
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shim  # noqa: F401  (the shim is active for every in-process test, as for a user)
from shim import gating
from shim.tools.report import silence_at_exit
from tests import devices

# The suite's own processes: their effects are the tests', not a run's; a fresh interpreter a test
# starts says what it says at exit, as for a user (tests/tools/test_exit_report.py).
silence_at_exit()

ROOT = Path(__file__).resolve().parents[1]
_counter = itertools.count()

#: The files that run first, longest first (as measured with --durations): under pytest-xdist (two
#: workers, a file per worker at a time, in this order: --no-loadscope-reorder) the long files start
#: early and the many short ones fill the end, so neither worker waits long for the other's last file.
FIRST = (
    "test_reliability.py",
    "test_do_no_harm.py",
    "test_device_check.py",
    "test_import_and_cli.py",
    "test_checkpointing_path.py",
    "test_shim_run.py",
    "test_switches.py",
    "test_cli_edges.py",
    "test_doctor.py",
    "test_catalogue.py",
    "test_checkpointing_saved_models.py",
    "test_checkpointing_call_signature.py",
    "test_effects_report.py",
)


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default=None,
        help="where the tests that compare gradients or run workflows run: cpu (the default) or cuda; "
        f"also {devices.VARIABLE} (tests/devices.py)",
    )


def pytest_configure(config):
    """Read the test device once; write it back to ``SHIM_TEST_DEVICE`` for the workflows' fresh
    interpreters (and xdist's workers), with what CUDA needs to repeat itself."""
    try:
        name = devices.chosen(config.getoption("--device"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(f"the test device is cuda, and torch {torch.__version__} sees no CUDA device")
        for key, value in devices.CUDA_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
    os.environ[devices.VARIABLE] = name


def pytest_generate_tests(metafunc):
    """A test marked ``autocast`` that takes ``device`` runs once per variant on CUDA; on a CPU it is
    left alone (one run, its name unchanged)."""
    if "device" not in metafunc.fixturenames or metafunc.definition.get_closest_marker("autocast") is None:
        return
    variants = devices.variants(devices.chosen())
    if len(variants) > 1:
        metafunc.parametrize("device", variants, ids=str)


@pytest.fixture
def device() -> devices.Device:
    """Where this test runs (``--device`` / ``SHIM_TEST_DEVICE``, ``tests/devices.py``)."""
    return devices.Device(devices.chosen())


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the on_device marks count
def pytest_collection_modifyitems(session, config, items):
    for item in items:  # what runs on the test device, for scripts/device-check.sh's -m on_device
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.on_device)
    rank = {name: index for index, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    """Write throwaway modules to a temp dir, as an installed distribution 1.2.0 of the same name
    (a dist-info folder beside the package); names are unique per test because the shim's
    post-import hooks are process-wide and never forgotten."""

    def make(**sources: str) -> str:
        prefix = f"fake{next(_counter)}_{os.getpid()}"
        package = tmp_path / prefix
        package.mkdir()
        (package / "__init__.py").write_text('__version__ = "1.2.0"\n')
        metadata = tmp_path / f"{prefix}-1.2.0.dist-info"
        metadata.mkdir()
        (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {prefix}\nVersion: 1.2.0\n")
        for name, source in sources.items():
            (package / f"{name}.py").write_text(textwrap.dedent(source))
        return prefix

    monkeypatch.syspath_prepend(str(tmp_path))
    return make


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """``shim/measured.json`` replaced by one that says ``{distribution: newest}``."""

    def write(newest):
        path = tmp_path / "measured.json"
        path.write_text(json.dumps({"about": "test", "oldest": newest, "newest": newest}))
        monkeypatch.setattr(gating, "MEASURED", str(path))
        gating.newest_measured.cache_clear()

    yield write
    gating.newest_measured.cache_clear()


def python_m_shim(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m shim ARGS`` in a fresh interpreter, as a user runs it (the SHIM_* variables only
    from ``env``); it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "shim", *args],
        env=clean_environment(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done


def clean_environment(env: dict | None = None) -> dict:
    """This process's environment without the SHIM_* variables, then ``env``: a fresh interpreter's
    switches are only those a test sets (the test device, ``SHIM_TEST_DEVICE``, is the suite's, and stays)."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") or k == devices.VARIABLE}
    return kept | (env or {})


_zygote = None


def zygote():
    """This process's :class:`tests.zygote.Zygote` (started on first use, closed at exit)."""
    global _zygote
    if _zygote is None:
        import atexit

        from tests.zygote import Zygote

        _zygote = Zygote(clean_environment({"PYTHONPATH": str(ROOT)}))
        atexit.register(_zygote.close)
    return _zygote


def run_python(
    code: str, env: dict | None = None, timeout: int = 300, torch_first: bool = False
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the SHIM_* variables only from ``env``.
    ``torch_first``: forked from one that has imported torch (``tests/zygote.py`` says when that is
    the same), which saves most of the stack's import."""
    if torch_first:
        result = zygote().run(textwrap.dedent(code), timeout, env=env)
        assert result.returncode is not None, f"hung for {timeout} s (killed):\n{result.stderr[-3000:]}"
        assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
        return result
    clean = clean_environment(env)
    clean["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=clean,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
    return result


class FrontLoader(importlib.machinery.SourceFileLoader):
    """What typeguard's and jaxtyping's import hooks hand the import system: a loader of their own."""


class FinderInFront:
    """A meta path finder inserted before the shim's after ``import shim``, as
    ``typeguard.install_import_hook(names)`` does: it answers for ``names`` without asking the
    finders after it, so the shim's finder never sees those imports."""

    def __init__(self, *names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        spec.loader = FrontLoader(spec.loader.name, spec.loader.path)
        return spec


@pytest.fixture
def finder_in_front():
    """``finder_in_front(*names)`` puts a :class:`FinderInFront` first in ``sys.meta_path``."""
    installed = []

    def install(*names):
        installed.append(FinderInFront(*names))
        sys.meta_path.insert(0, installed[-1])

    yield install
    sys.meta_path[:] = [finder for finder in sys.meta_path if finder not in installed]
