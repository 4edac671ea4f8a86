"""``python -m shim new-pack NAME [DIR]``: write a patch pack that works as it is, to start one from.

NAME (kebab-case, as patch names are) names the distribution, its package (``my_fixes``) and its
first patch. The pack installs with pip, and ``python -m shim`` lists its patch, ``SHIM_DISABLE``
opts it out and ``python -m shim doctor NAME`` checks it, with no edit: the patch passes every call
of ``transformers.trainer_utils.set_seed`` through, gated on the installed transformers' major
release, and its bug probe finds no bug until its author writes one. docs/adding-a-patch.md says
what to change. A development tool: nothing of it runs at ``import shim``.
"""

from __future__ import annotations

import os
import textwrap

from .. import gating
from ..settings import PATCH_NAME, shown
from .packindex import block
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

from shim import Evidence, Patch, Target

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
# its target modules is imported, and `python -m shim pack-index` lists those in pyproject.toml.
PATCH = Patch(
    name=NAME,
    summary="What the patch fixes, in one line.",
    # The gate: the releases of the library that have the bug (read them; an upper bound makes you
    # look again at the next major release).
    distribution="transformers",
    requires="{requires}",
    targets=(Target("{target}", _fix),),
    bug_probe=_bug_probe,
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
    result = subprocess.run([sys.executable, "-m", "shim", "pack-index", "--check", root], capture_output=True, text=True)
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
its docstring), then run `python -m shim pack-index` to list the new target modules in
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


def new_pack(name: str, folder: str | None = None) -> int:
    """Write the pack ``name`` into ``folder`` (default: ``./NAME``): 0, or 2 where ``name`` is no
    patch name or ``folder`` holds files already (said on stderr)."""
    if not PATCH_NAME.match(name):
        say(f"python -m shim new-pack: {shown(name)} is not a patch name (kebab-case, e.g. 'my-team-fixes')")
        return 2
    folder = folder or name
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        say(f"python -m shim new-pack: {shown(folder, 200)} exists and is not an empty folder")
        return 2
    for path, text in files(name).items():
        target = os.path.join(folder, path)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with open(target, "w", encoding="utf-8") as file:
            file.write(text)
    print(
        textwrap.dedent(f"""\
        {folder}: the patch pack {name}, patch {name} on {TARGET}
        next: pip install -e {folder}, then python -m shim doctor {name}""")
    )
    return 0
