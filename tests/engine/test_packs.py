"""Patch packs (``shim.packs``): patches of other distributions, found through the entry-point group
``hf_train_shim.patches``. Each pack here is written to disk as an installed distribution looks (a
``.dist-info`` folder with ``METADATA`` and ``entry_points.txt`` beside its package), so discovery
reads what it would read in a real environment. The example pack, built and installed, is
tests/tools/test_patch_pack.py's."""

import itertools
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import shim
from shim import packs
from shim.registry import Registry
from tests.conftest import ROOT, clean_environment

_counter = itertools.count()
BUILTIN = tuple(shim.registry.names)

GOOD = """
from shim import Patch, Target, record_effect

def _double(wrapped, instance, args, kwargs):
    record_effect(NAME, "doubled")
    return 2 * wrapped(*args, **kwargs)

PATCH = Patch(name=NAME, summary="doubles one()", distribution=DIST, requires=">=1.0",
              targets=(Target(TARGET + ":one", _double),), self_check=lambda: False)
"""


def write_pack(root, entry_points, source=GOOD, version="1.2.0", name=None):
    """An installed distribution under ``root``: package ``<name>`` with a target module ``target``
    (``one()`` returns 1) and a module ``fixes`` from ``source``, and ``entry_points`` as its
    ``[hf_train_shim.patches]`` section (``{patch name: value}``, ``{n}`` stands for the package)."""
    name = name or f"tpack{next(_counter)}_{os.getpid()}"
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (package / "target.py").write_text("def one():\n    return 1\n")
    header = f"NAME = {next(iter(entry_points), '')!r}\nDIST = {name!r}\nTARGET = '{name}.target'\n"
    (package / "fixes.py").write_text(header + textwrap.dedent(source))
    metadata = root / f"{name}-{version}.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    lines = [f"{key} = {value.format(n=name)}" for key, value in entry_points.items()]
    (metadata / "entry_points.txt").write_text(
        "[console_scripts]\nsomething = x:y\n\n[hf_train_shim.patches]\n" + "\n".join(lines) + "\n"
    )
    return name


def load(root, builtin=BUILTIN):
    """``packs.load`` on ``root`` alone, and the ShimWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = []
        packs.load(builtin, loaded.append, paths=[str(root)])
    return loaded, [str(w.message) for w in caught if issubclass(w.category, shim.ShimWarning)]


def test_discovery_reads_only_the_group_of_each_distribution(tmp_path):
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"})
    other = tmp_path / "other-2.0.dist-info"  # entry points of another group only
    other.mkdir()
    (other / "entry_points.txt").write_text("[console_scripts]\nhf_train_shim.patches = x:y\n")
    (tmp_path / "plain-1.0.dist-info").mkdir()  # no entry point at all
    (found,) = packs.found([str(tmp_path), str(tmp_path / "missing"), str(tmp_path / "a.zip")])
    assert (found.name, found.value) == ("double-one", f"{name}.fixes:PATCH")
    assert (found.distribution, found.version) == (name.replace("_", "-"), "1.2.0")
    assert f"{name}.fixes" not in sys.modules, "discovery imports nothing"


def test_a_distribution_found_twice_counts_where_it_is_first_on_the_path(tmp_path):
    name = write_pack(tmp_path / "first", {"double-one": "{n}.fixes:PATCH"})
    write_pack(tmp_path / "second", {"double-one": "{n}.fixes:PATCH", "other-name": "{n}.fixes:PATCH"}, name=name)
    found = packs.found([str(tmp_path / "first"), str(tmp_path / "second")])
    assert [(f.name, os.path.dirname(f.folder)) for f in found] == [("double-one", str(tmp_path / "first"))]


def activated(tmp_path, monkeypatch, version="1.2.0"):
    """A registry of one pack's patch ``double-one`` on ``<name>.target:one``, activated (its target
    not imported yet); the registry and the pack's package name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, version=version)
    (pack,) = load(tmp_path)[0]
    registry = Registry([pack])
    registry.activate()
    return registry, name


def test_a_pack_patch_joins_a_registry_with_its_gate_switches_and_provider(tmp_path, monkeypatch):
    registry, name = activated(tmp_path, monkeypatch)
    assert f"{name}.target" not in sys.modules, "activation waits for the target module"
    target = __import__(f"{name}.target", fromlist=["one"])
    (status,) = registry.status()
    assert (status.state, status.provider, status.installed) == ("applied", name.replace("_", "-"), "1.2.0")
    assert target.one() == 2 and registry.status()[0].effects == status.effects + 1
    with registry.disabled("double-one"):
        assert target.one() == 1
    registry.deactivate()
    assert target.one() == 1


def test_shim_force_applies_a_pack_patch_outside_its_gate(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIM_FORCE", "double-one")
    registry, name = activated(tmp_path, monkeypatch, version="0.9")
    target = __import__(f"{name}.target", fromlist=["one"])
    (status,) = registry.status()
    assert status.state == "applied" and "outside >=1.0, applied anyway because of SHIM_FORCE" in status.reason
    assert target.one() == 2
    registry.deactivate()


def test_another_patcher_on_a_pack_target_is_named_as_on_a_built_in(tmp_path, monkeypatch):
    registry, name = activated(tmp_path, monkeypatch)
    target = __import__(f"{name}.target", fromlist=["one"])
    target.one = lambda: 1  # another patcher's assignment replaces the pack's layer
    (status,) = registry.status()
    assert status.state == "failed"
    assert status.reason.startswith(f"{name}.target:one was replaced by tests.engine.test_packs:test_another_")
    assert [(other["relation"], other["file"]) for other in status.others] == [("bypassed", __file__)]
    registry.deactivate()


BROKEN = {
    "import error": ({"broken-import": "{n}.missing_module:PATCH"}, GOOD, "cannot be imported (ModuleNotFoundError"),
    "not a Patch": ({"not-a-patch": "{n}.fixes:PATCH"}, "PATCH = {'name': NAME}", "is a dict, not a shim.Patch"),
    "another name": ({"called-this": "{n}.fixes:PATCH"}, GOOD.replace("name=NAME", "name='that'"), "called 'that'"),
    "no attribute": ({"no-attribute": "{n}.fixes"}, GOOD, "is not 'module:attribute'"),
    "not a name": ({"Not_A_Name": "{n}.fixes:PATCH"}, GOOD, "is not a patch name"),
    "built-in": ({"checkpointing-restore": "{n}.fixes:PATCH"}, GOOD, "claims the name of the built-in patch"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_pack_warns_once_naming_it_and_the_others_load(tmp_path, monkeypatch, case):
    monkeypatch.syspath_prepend(str(tmp_path))
    entry_points, source, problem = BROKEN[case]
    broken = write_pack(tmp_path, entry_points, source=source, name=f"a_broken{next(_counter)}")  # found first
    good = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"})
    loaded, warned = load(tmp_path)
    assert [(p.name, p.provider) for p in loaded] == [("double-one", good.replace("_", "-"))]
    (message,) = warned
    (entry_point,) = entry_points
    assert (
        f"patch pack {broken.replace('_', '-')} 1.2.0, entry point hf_train_shim.patches '{entry_point} = " in message
    )
    assert problem in message and "\n" not in message
    if case == "built-in":
        assert f"{broken}.fixes" not in sys.modules, "a name that is taken is refused before the module is imported"
    assert load(tmp_path)[1] == [], "once per process"


def test_two_packs_claiming_one_name_keep_the_first_on_the_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    first = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name=f"a_first{next(_counter)}")
    second = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name=f"b_second{next(_counter)}")
    loaded, (message,) = load(tmp_path)
    assert [p.provider for p in loaded] == [first.replace("_", "-")]
    assert f"patch pack {second.replace('_', '-')} 1.2.0" in message
    assert f"claims the name of {first.replace('_', '-')} 1.2.0's patch 'double-one'" in message
    assert f"{second}.fixes" not in sys.modules


def test_strict_mode_raises_patch_error_for_a_broken_pack(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write_pack(tmp_path, {"not-a-patch": "{n}.fixes:PATCH"}, source="PATCH = 42")
    monkeypatch.setenv("SHIM_STRICT", "1")
    with pytest.raises(shim.PatchError, match=r"entry point hf_train_shim.patches 'not-a-patch = .*SHIM_STRICT=1"):
        packs.load(BUILTIN, list.append, paths=[str(tmp_path)])


# -- import shim in a fresh interpreter, with packs installed ---------------------------------------

IMPORT = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import shim
    import shim
print(json.dumps({
    "warnings": [str(w.message) for w in caught if issubclass(w.category, shim.ShimWarning)],
    "names": list(shim.registry.names),
    "loaded": sorted(m for m in sys.modules if m.startswith("tpack") or m == "packaging.specifiers"),
}))
"""


def import_shim(site, code=IMPORT, **env) -> subprocess.CompletedProcess:
    """``python -c code`` with the packs under ``site`` installed (``None``: none), the SHIM_*
    variables only from ``env``."""
    clean = clean_environment(env)
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(site or "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, cwd=ROOT)


def test_import_shim_with_broken_packs_warns_once_each_and_changes_nothing_else(tmp_path):
    write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name="tpack_good")
    for case in ("import error", "not a Patch", "built-in"):
        entry_points, source, _ = BROKEN[case]
        write_pack(tmp_path, entry_points, source=source)
    write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name="tpack_same_name")
    result = import_shim(tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["names"] == [*BUILTIN, "double-one"], "the built-ins, then the one good pack"
    assert len(out["warnings"]) == 4, out["warnings"]
    assert all(message.startswith("patch pack tpack") for message in out["warnings"])
    assert "tpack_good.fixes" in out["loaded"] and "tpack_good.target" not in out["loaded"], (
        "a pack's target waits for its import"
    )


def test_import_shim_without_a_pack_imports_no_pack_machinery():
    out = json.loads(import_shim(None).stdout)
    assert out["names"] == list(BUILTIN) and out["warnings"] == []
    assert "packaging.specifiers" not in out["loaded"]


def test_strict_import_shim_raises_for_a_broken_pack(tmp_path):
    write_pack(tmp_path, *BROKEN["import error"][:2])
    result = import_shim(tmp_path, SHIM_STRICT="1")
    assert result.returncode == 1
    assert "shim.settings.PatchError: patch pack tpack" in result.stderr and "(SHIM_STRICT=1)" in result.stderr


def test_a_pack_module_imported_before_the_shim_joins_once_its_import_is_done(tmp_path):
    # The pack's own tests do this: its module imports shim at its top, and the shim finds that very
    # module mid-import, without its Patch yet.
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"})
    code = f"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from {name} import fixes
    import shim
    from {name} import target
    states = {{s.name: s.state for s in shim.status()}}
print(json.dumps({{"state": states.get("double-one"), "one": target.one(),
                  "warnings": [str(w.message) for w in caught if "patch pack" in str(w.message)]}}))
"""
    result = import_shim(tmp_path, code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"state": "applied", "one": 2, "warnings": []}
