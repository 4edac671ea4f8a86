"""``python -m shim new-pack NAME [DIR]``: write a patch pack that works as it is, to start one from.

NAME (kebab-case, as patch names are) names the distribution, its package (``my_fixes``) and its
first patch. The pack installs with pip, and ``python -m shim`` lists its patch, ``SHIM_DISABLE``
opts it out and ``python -m shim doctor NAME`` checks it, with no edit: the patch passes every call
of ``transformers.trainer_utils.set_seed`` through, gated on the installed transformers' major
release, and its bug probe finds no bug until its author writes one. docs/adding-a-patch.md says
what to change. A development tool: nothing of it runs at ``import shim``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

from .. import gating
from ..catalogue import builtin
from ..settings import PATCH_NAME, shown
from .index import block
from .run import say

TARGET = "transformers.trainer_utils:set_seed"

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
description = "A patch pack for hf-train-shim"
requires-python = ">=3.10"
dependencies = ["hf-train-shim", "transformers{requires}"]

# Each entry point's name is a patch's name, its value the module's Patch: `import shim` and
# `shim-run` apply it once this distribution is installed.
[project.entry-points."hf_train_shim.patches"]
{name} = "{package}.fixes:PATCH"

{targets}
[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

INIT = '''\
"""{name}: a patch pack for hf-train-shim. ``fixes`` declares its patch (``PATCH``)."""

__version__ = "0.1.0"
'''

FIXES = '''\
"""``{name}``: the symptom, in one line.

Symptom: what a user sees, with the exact error message.

Cause: the upstream function and what it does wrong, in which releases; a public reference
(``owner/repo#N``).

Fix: what the wrapper changes, and only where the bug shows.

Limits: what the fix does not cover.

This docstring is what ``python -m shim explain {name}`` prints below the summary.
"""

import sys

from shim import BugProbe, Evidence, Patch, Target

NAME = "{name}"


def _fix(wrapped, instance, args, kwargs):
    """Every call of the target passes through here: keep the usual path to one call of
    ``wrapped``. Where the bug shows, change what needs changing and count it with
    ``shim.record_effect(NAME, "what changed")``."""
    return wrapped(*args, **kwargs)


def _bug_probe() -> Evidence:
    """The bug probe: does the installed code have the bug? ``python -m shim doctor`` asks it with
    the patch off, then on; the shim asks it before applying the patch where the release cannot
    vouch for the code (a dev build, a release newer than any measured), and the patch steps aside
    where it finds no bug. Build the smallest case of the bug in code, in a millisecond or two,
    from modules already imported (``sys.modules``: a probe imports nothing), and say what you saw
    either way. ``shim.selfcheck.bare`` builds bare transformers models and layers."""
    set_seed = sys.modules["transformers.trainer_utils"].set_seed
    set_seed(0)
    return Evidence(False, "describe here what the case showed")


# The module stays light (the shim and the standard library): the shim imports it when one of
# its target modules is imported, and `python -m shim index` lists those in pyproject.toml.
PATCH = Patch(
    name=NAME,
    summary="What the patch fixes, in one line.",
    # The gate: the releases of the library that have the bug (read them; an upper bound makes you
    # look again at the next major release).
    distribution="transformers",
    requires="{requires}",
    targets=(Target("{target}", _fix),),
    bug_probe=BugProbe(_bug_probe),
)
'''

TEST = '''\
"""The pack's own tests: run them where the pack is installed (pip install -e . && pytest)."""

import os
import subprocess
import sys

from {package}.fixes import NAME

import shim


def test_the_patch_applies_when_its_target_is_imported():
    import transformers.trainer_utils  # noqa: F401  (its target module)

    (status,) = [s for s in shim.status() if s.name == NAME]
    assert status.state == "applied", status.reason
    assert status.provider == "{name}"


def bug_found() -> bool:
    """Whether the patch's bug probe finds its bug now, as ``python -m shim doctor`` asks it."""
    return any(probe.ask().present for probe in shim.registry.patch(NAME).probes)


def test_the_bug_probe_finds_no_bug_with_the_patch_on():
    with shim.disabled(NAME):
        bug_found()  # once it builds the bug: assert bug_found()
    assert not bug_found()


def test_pyproject_lists_the_target_modules():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "shim", "index", "--check", root], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
'''

README = """\
# {name}

A patch pack for [hf-train-shim](https://pypi.org/project/hf-train-shim/): install it beside the
shim, and `import shim` applies its patch `{name}`.

```sh
pip install -e .
python -m shim                    # lists {name}, from: {name} (a patch pack)
python -m shim doctor {name}      # its bug probe, with the patch off, then on
SHIM_DISABLE={name} python train.py   # opted out: its module is not even imported
python -m pytest
```

Change `src/{package}/fixes.py` (the target, the wrapper, the gate, the bug probe, the story in
its docstring), then run `python -m shim index` to list the new target modules in
`pyproject.toml`, and reinstall.
"""


def requires() -> str:
    """The gate of a new pack's patch: the installed transformers' major release (5 where it is not
    installed)."""
    installed = gating.installed_version("transformers")
    major = int(installed.partition(".")[0]) if installed and installed.partition(".")[0].isdigit() else 5
    return f">={major}.0,<{major + 1}"


def files(name: str) -> dict[str, str]:
    """``{relative path: text}`` of a new pack called ``name``."""
    package = name.replace("-", "_")
    gate = requires()
    fields = {"name": name, "package": package, "requires": gate, "target": TARGET}
    fields["targets"] = block({name: (TARGET.partition(":")[0],)})
    return {
        "pyproject.toml": PYPROJECT.format(**fields),
        f"src/{package}/__init__.py": INIT.format(**fields),
        f"src/{package}/fixes.py": FIXES.format(**fields),
        f"tests/test_{package}.py": TEST.format(**fields),
        "README.md": README.format(**fields),
    }


#: The longest name a pack may have: its package's test file (``test_<package>.py``) stays within
#: every file system's 255-byte name, and its status row within the table's 100 columns.
LONGEST = 64


def refused(name: str) -> str | None:
    """Why ``name`` cannot name a new pack (one line), or ``None``: not a patch name, too long, a
    built-in patch's name, or a package that would shadow an importable module (``shim``,
    ``torch``, ``json``, ...: where the pack's ``src`` is on ``sys.path``, ``import`` would find the
    pack's package instead, and ``import shim`` would silently apply nothing)."""
    if not PATCH_NAME.match(name):
        return f"{shown(name)} is not a patch name (kebab-case, e.g. 'my-team-fixes')"
    if len(name) > LONGEST:
        return f"{shown(name)} is longer than {LONGEST} characters"
    if name in {listing.name for listing in builtin()}:
        return f"{shown(name)} is a built-in patch's name: a pack's patch needs its own"
    package = name.replace("-", "_")
    if package in sys.stdlib_module_names or package in sys.builtin_module_names:
        return f"its package {package!r} would shadow the standard library's module {package!r}"
    if importable(package):
        return f"its package {package!r} would shadow the module {package!r} importable here"
    return None


def importable(package: str) -> bool:
    """Whether ``import package`` finds a module now (searched for, not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken one
        return True


def unusable(folder: str) -> str | None:
    """Why ``folder`` cannot take a new pack (one line), or ``None``: it must be new or empty."""
    if os.path.islink(folder) and not os.path.exists(folder):
        return f"{shown(folder, 200)} is a symbolic link to nothing"
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        return f"{shown(folder, 200)} exists and is not an empty folder"
    return None


def new_pack(name: str, folder: str | None = None) -> int:
    """Write the pack ``name`` into ``folder`` (default: ``./NAME``): 0, or 2 where ``name`` is
    :func:`refused`, ``folder`` is :func:`unusable` or a file cannot be written (one line on stderr)."""
    folder = folder or name
    try:
        problem = refused(name) or unusable(folder)
        if problem is None:
            write(folder, files(name))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the folder's name
        problem = f"cannot write into {shown(folder, 200)}: {getattr(exc, 'strerror', None) or exc}"
    if problem:
        say(f"python -m shim new-pack: {problem}")
        return 2
    print(
        textwrap.dedent(f"""\
        {folder}: the patch pack {name}, patch {name} on {TARGET}
        next: pip install -e {folder}, then python -m shim doctor {name}""")
    )
    return 0


def write(folder: str, texts: dict[str, str]) -> None:
    """Each ``{relative path: text}`` of ``texts`` written under ``folder``."""
    for path, text in texts.items():
        target = os.path.join(folder, path)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with open(target, "w", encoding="utf-8") as file:
            file.write(text)
