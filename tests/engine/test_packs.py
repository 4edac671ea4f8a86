"""Patch packs (``shim.packs``): patches of other distributions, found through the entry-point group
``hf_train_shim.patches``, their target modules listed in ``hf_train_shim.targets``. Each pack here
is written to disk as an installed distribution looks (a ``.dist-info`` folder with ``METADATA`` and
``entry_points.txt`` beside its package), so discovery reads what it would read in a real
environment. The example pack and a new pack's scaffold, built and installed, are
tests/tools/test_patch_pack.py's and tests/tools/test_new_pack.py's."""

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

import shim
from shim import catalogue, packs
from shim.registry import Registry
from tests.conftest import ROOT, clean_environment

_counter = itertools.count()
BUILTIN = tuple(shim.registry.names)

GOOD = """
from shim import Evidence, Patch, Target, record_effect

def _double(wrapped, instance, args, kwargs):
    record_effect(NAME, "doubled")
    return 2 * wrapped(*args, **kwargs)

PATCH = Patch(name=NAME, summary="doubles one()", distribution=DIST, requires=">=1.0",
              targets=(Target(TARGET + ":one", _double),), bug_probe=lambda: Evidence(False, "one() doubles"))
"""


def write_pack(
    root, entry_points, source=GOOD, version="1.2.0", name=None, listed=True, metadata=None, order=(), target=None
):
    """An installed distribution under ``root``: package ``<name>`` with a target module ``target``
    (``one()`` returns 1) and a module ``fixes`` from ``source``, ``entry_points`` as its
    ``[hf_train_shim.patches]`` section (``{patch name: value}``, ``{n}`` stands for the package)
    and, where ``listed``, ``<name>.target`` as each patch's target module in ``[hf_train_shim.targets]``.
    ``metadata``: the bytes of its METADATA (default: its name and version); ``order``: the lines of
    its ``[hf_train_shim.order]`` section; ``target``: the module its patches target (default its own)."""
    name = name or f"tpack{next(_counter)}_{os.getpid()}"
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (package / "target.py").write_text("def one():\n    return 1\n")
    target = target or f"{name}.target"
    header = f"NAME = {next(iter(entry_points), '')!r}\nDIST = {name!r}\nTARGET = {target!r}\n"
    (package / "fixes.py").write_text(header + textwrap.dedent(source))
    folder = root / f"{name}-{version}.dist-info"
    folder.mkdir()
    default = f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n".encode()
    (folder / "METADATA").write_bytes(metadata if metadata is not None else default)
    lines = [f"{key} = {value.format(n=name)}" for key, value in entry_points.items()]
    targets = [f"{key}.{target} = {target}" for key in entry_points] if listed else []
    (folder / "entry_points.txt").write_text(
        "[console_scripts]\nsomething = x:y\n\n[hf_train_shim.patches]\n"
        + "\n".join(lines)
        + "\n\n[hf_train_shim.targets]\n"
        + "\n".join(targets)
        + "\n\n[hf_train_shim.order]\n"
        + "\n".join(f"{line} = {name}.fixes" for line in order)
        + "\n"
    )
    return name


def registered(root, builtin=True):
    """A registry of the built-ins' listings (or none) with the packs under ``root`` registered, not
    activated; the packs it holds and the ShimWarnings that registering gave."""
    registry = Registry(catalogue.builtin() if builtin else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packs.load(registry, paths=[str(root)])
    held = [registry.declared(name) for name in registry.names if name not in BUILTIN]
    return registry, held, said(caught)


def said(caught):
    return [str(w.message) for w in caught if issubclass(w.category, shim.ShimWarning)]


def test_discovery_reads_only_the_groups_of_each_distribution(tmp_path):
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"})
    unlisted = write_pack(tmp_path, {"triple-one": "{n}.fixes:PATCH"}, listed=False)
    other = tmp_path / "other-2.0.dist-info"  # entry points of another group only
    other.mkdir()
    (other / "entry_points.txt").write_text("[console_scripts]\nhf_train_shim.patches = x:y\n")
    (tmp_path / "plain-1.0.dist-info").mkdir()  # no entry point at all
    found = packs.found([str(tmp_path), str(tmp_path / "missing"), str(tmp_path / "a.zip")])
    assert [(f.name, f.module, f.attribute, f.modules) for f in found] == [
        ("double-one", f"{name}.fixes", "PATCH", (f"{name}.target",)),
        ("triple-one", f"{unlisted}.fixes", "PATCH", ()),
    ]
    assert (found[0].provider, found[0].version, found[0].requires) == (name.replace("_", "-"), "1.2.0", None)
    assert not {f"{name}.fixes", f"{unlisted}.fixes"} & set(sys.modules), "discovery imports nothing"


def test_a_distribution_found_twice_counts_where_it_is_first_on_the_path(tmp_path):
    name = write_pack(tmp_path / "first", {"double-one": "{n}.fixes:PATCH"})
    write_pack(tmp_path / "second", {"double-one": "{n}.fixes:PATCH", "other-name": "{n}.fixes:PATCH"}, name=name)
    (tmp_path / "second" / f"{name.replace('_', '.').upper()}-9.dist-info").mkdir()  # the same name, spelled so
    found = packs.found([str(tmp_path / "first"), str(tmp_path / "second")])
    assert [f.name for f in found] == ["double-one"]


def activated(tmp_path, monkeypatch, version="1.2.0", **options):
    """A registry of one pack's patch ``double-one`` on ``<name>.target:one``, activated (its target
    not imported yet); the registry and the pack's package name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, version=version, **options)
    registry = registered(tmp_path, builtin=False)[0]
    registry.activate()
    return registry, name


def test_a_pack_patch_joins_a_registry_with_its_gate_switches_and_provider(tmp_path, monkeypatch):
    registry, name = activated(tmp_path, monkeypatch)
    assert f"{name}.fixes" not in sys.modules, "its module waits for its target module"
    target = __import__(f"{name}.target", fromlist=["one"])
    assert f"{name}.fixes" in sys.modules
    (status,) = registry.status()
    assert (status.state, status.provider, status.installed) == ("applied", name.replace("_", "-"), "1.2.0")
    assert target.one() == 2 and registry.status()[0].effects == status.effects + 1
    with registry.disabled("double-one"):
        assert target.one() == 1
    registry.deactivate()
    assert target.one() == 1


def test_a_pack_without_a_record_is_refused_with_the_command_that_writes_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, listed=False)
    _registry, held, (message,) = registered(tmp_path)
    assert held == [] and f"{name}.fixes" not in sys.modules
    assert message.startswith(message_of(name, "double-one"))
    assert "its record lists no target modules (hf_train_shim.targets): run python -m shim index" in message


@pytest.mark.parametrize("switch", ["all", "double-one"])
def test_a_pack_patch_switched_off_never_has_its_module_imported(tmp_path, monkeypatch, switch):
    monkeypatch.setenv("SHIM_DISABLE", switch)
    registry, name = activated(tmp_path, monkeypatch)
    target = __import__(f"{name}.target", fromlist=["one"])
    (status,) = registry.status()
    assert target.one() == 1 and f"{name}.fixes" not in sys.modules
    assert status.state == "disabled" and "its module is not imported while it is switched off" in status.reason
    assert (status.requires, status.summary) == ("", "")
    registry.enable("double-one")  # asked for by name: now it is imported, and applies
    assert f"{name}.fixes" in sys.modules and target.one() == 2
    registry.deactivate()


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


# -- a pack left out --------------------------------------------------------------------------------

#: Refused by its name, before its module is imported: warned when the shim starts.
CLAIMS = {
    "not a name": ({"Not_A_Name": "{n}.fixes:PATCH"}, "is not a patch name"),
    "built-in": ({"checkpointing-restore": "{n}.fixes:PATCH"}, "claims the name of the built-in patch"),
    "no attribute": ({"no-attribute": "{n}.fixes"}, "is not 'module:attribute'"),
}
#: Found broken when its module is imported (at its target's import): warned then, the patch failed.
BROKEN = {
    "import error": ({"broken-import": "{n}.missing_module:PATCH"}, GOOD, "cannot be imported (ModuleNotFoundError"),
    "exits at import": ({"exits-at-import": "{n}.fixes:PATCH"}, "import argparse\nargparse.ArgumentParser().parse_args(['--lr', '1'])", "cannot be imported (SystemExit(2)"),
    "not a Patch": ({"not-a-patch": "{n}.fixes:PATCH"}, "PATCH = {'name': NAME}", "is a dict, not a shim.Patch"),
    "another name": ({"called-this": "{n}.fixes:PATCH"}, GOOD.replace("name=NAME", "name='that'"), "its module's Patch is 'that'"),
    "stale list": ({"stale-list": "{n}.fixes:PATCH"}, GOOD.replace('TARGET + ":one"', '"json:dumps"'), "run python -m shim index"),
}  # fmt: skip


def message_of(name, entry_point):
    return f"patch pack {name.replace('_', '-')} 1.2.0, entry point hf_train_shim.patches '{entry_point} = "


@pytest.mark.parametrize("case", list(CLAIMS))
def test_a_pack_claiming_a_name_it_cannot_have_warns_once_and_is_never_imported(tmp_path, monkeypatch, case):
    monkeypatch.syspath_prepend(str(tmp_path))
    entry_points, problem = CLAIMS[case]
    broken = write_pack(tmp_path, entry_points, name=f"a_broken{next(_counter)}")  # found first
    good = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"})
    _registry, held, warned = registered(tmp_path)
    assert [(p.name, p.provider) for p in held] == [("double-one", good.replace("_", "-"))]
    (message,) = warned
    assert message.startswith(message_of(broken, next(iter(entry_points)))) and problem in message
    assert "\n" not in message and f"{broken}.fixes" not in sys.modules
    assert registered(tmp_path)[2] == [], "once per process"


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_pack_fails_with_one_warning_when_its_target_is_imported(tmp_path, monkeypatch, case):
    monkeypatch.syspath_prepend(str(tmp_path))
    entry_points, source, problem = BROKEN[case]
    broken = write_pack(tmp_path, entry_points, source=source, name=f"a_broken{next(_counter)}")
    good = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"})
    registry, held, warned = registered(tmp_path, builtin=False)
    assert warned == [] and [p.name for p in held] == [*entry_points, "double-one"], "nothing imported yet"
    registry.activate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(f"{broken}.target")
        assert __import__(f"{good}.target", fromlist=["one"]).one() == 2, "the other pack applies"
        statuses = {s.name: s for s in registry.status()}
        registry.status()
    (message,) = said(caught)
    (entry_point,) = entry_points
    assert message.startswith(message_of(broken, entry_point)) and problem in message and "\n" not in message
    assert statuses[entry_point].state == "failed" and problem in statuses[entry_point].reason
    registry.deactivate()


def test_a_keyboard_interrupt_in_a_pack_module_reaches_the_user(tmp_path, monkeypatch):
    registry, name = activated(tmp_path, monkeypatch, listed=True)
    (tmp_path / name / "fixes.py").write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        __import__(f"{name}.target")
    registry.deactivate()


def test_two_packs_claiming_one_name_keep_the_first_on_the_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    first = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name=f"a_first{next(_counter)}")
    second = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name=f"b_second{next(_counter)}")
    _registry, held, (message,) = registered(tmp_path)
    assert [p.provider for p in held] == [first.replace("_", "-")]
    assert f"patch pack {second.replace('_', '-')} 1.2.0" in message
    assert f"claims the name of {first.replace('_', '-')} 1.2.0's patch 'double-one'" in message
    assert f"{second}.fixes" not in sys.modules


def test_strict_mode_raises_patch_error_for_a_broken_pack(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIM_STRICT", "1")
    write_pack(tmp_path, *CLAIMS["built-in"][:1])
    with pytest.raises(shim.PatchError, match=r"entry point hf_train_shim.patches 'checkpointing-restore = .*STRICT=1"):
        registered(tmp_path)
    registry, name = activated(tmp_path / "lazy", monkeypatch)
    (tmp_path / "lazy" / name / "fixes.py").write_text("PATCH = 42\n")
    with pytest.raises(shim.PatchError, match=r"'double-one' did not apply: patch pack .* is a int, not a shim.Patch"):
        __import__(f"{name}.target")
    registry.deactivate()


# -- discovery that survives any installed distribution ------------------------------------------

LATIN_1 = "Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.0\nAuthor: Fran\xe7ois\n".encode("latin-1")


def metadata_folder(tmp_path, name="odd", declares=True):
    folder = tmp_path / f"{name}-1.0.dist-info"
    folder.mkdir(parents=True)
    text = "[hf_train_shim.patches]\nodd-fix = odd.fixes:PATCH\n" if declares else "[console_scripts]\nodd = odd:main\n"
    return folder, text


def discovered(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = packs.found([str(tmp_path)])
    return found, said(caught)


@pytest.mark.parametrize("declares", [True, False], ids=["declares the group", "does not"])
@pytest.mark.parametrize(
    "case", ["entry_points.txt not UTF-8", "entry_points.txt over 1 MiB", "entry_points.txt a FIFO", "entry_points.txt a folder"]
)  # fmt: skip
def test_an_unreadable_entry_points_txt_leaves_its_distribution_out(tmp_path, case, declares):
    folder, text = metadata_folder(tmp_path, declares=declares)
    path = folder / "entry_points.txt"
    if case.endswith("not UTF-8"):
        path.write_bytes(text.encode() + b"# caf\xe9\n")
    elif case.endswith("1 MiB"):
        path.write_bytes(text.encode() + b"#" * packs.LIMIT)
    elif case.endswith("FIFO"):
        os.mkfifo(path)  # nobody writes it: reading it would wait for ever
    else:
        path.mkdir()
    good = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"})
    started = time.monotonic()
    found, warned = discovered(tmp_path)
    assert time.monotonic() - started < 5
    assert [f.provider for f in found] == [good.replace("_", "-")]
    if declares and case.split()[-1] not in ("FIFO", "folder"):  # a file not read cannot be said to declare it
        (message,) = warned
        assert message.startswith("patch pack 'odd-1.0.dist-info': its entry_points.txt ") and "left out" in message
    else:
        assert warned == []


@pytest.mark.parametrize("case", ["not UTF-8", "a FIFO", "a folder", "over 1 MiB"])
def test_a_pack_whose_metadata_cannot_be_read_is_left_out_with_one_warning(tmp_path, case):
    folder, text = metadata_folder(tmp_path)
    (folder / "entry_points.txt").write_text(text)
    path = folder / "METADATA"
    if case == "not UTF-8":
        path.write_bytes(LATIN_1.replace(b"{name}", b"odd"))
    elif case == "a FIFO":
        os.mkfifo(path)
    elif case == "a folder":
        path.mkdir()
    else:
        path.write_bytes(b"Name: odd\n" + b"x" * packs.LIMIT)
    found, (message,) = discovered(tmp_path)
    assert found == [] and message.startswith("patch pack 'odd-1.0.dist-info': its METADATA ")


def test_a_large_unrelated_entry_points_txt_is_not_read_past_its_limit(tmp_path):
    folder, text = metadata_folder(tmp_path, declares=False)
    (folder / "entry_points.txt").write_bytes(text.encode() + b"# filler\n" * 6_000_000)  # 54 MB
    read = []
    real_read = os.read
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(os, "read", lambda fd, n: read.append(len(data := real_read(fd, n))) or data)
        assert discovered(tmp_path) == ([], [])
    assert sum(read) <= packs.LIMIT + 1


# -- import shim in a fresh interpreter, with packs installed ---------------------------------------

IMPORT = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import shim
    import shim
    TARGETS
print(json.dumps({
    "warnings": [str(w.message) for w in caught if issubclass(w.category, shim.ShimWarning)],
    "names": list(shim.registry.names),
    "loaded": sorted(m for m in sys.modules if m.startswith("tpack") or m == "packaging.specifiers"),
    "states": {s.name: str(s.state) for s in shim.status() if s.name not in BUILTIN},
}))
"""


def import_shim(site, code=IMPORT, targets=(), **env) -> subprocess.CompletedProcess:
    """``python -c code`` with the packs under ``site`` installed (``None``: none), importing the
    modules ``targets`` after the shim, the SHIM_* variables only from ``env``."""
    clean = clean_environment(env)
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(site or "")]))
    code = code.replace("TARGETS", "; ".join(f"import {t}" for t in targets) or "pass")
    code = code.replace("BUILTIN", repr(BUILTIN))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, cwd=ROOT)


def test_import_shim_imports_no_pack_module_and_warns_only_of_names_it_refuses(tmp_path):
    write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name="tpack_good")
    for case in ("import error", "not a Patch", "exits at import"):
        entry_points, source, _ = BROKEN[case]
        write_pack(tmp_path, entry_points, source=source, name=f"tpack_{case.replace(' ', '_')}")
    write_pack(tmp_path, *CLAIMS["built-in"][:1])
    write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name="tpack_same_name")
    result = import_shim(tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["names"][: len(BUILTIN)] == list(BUILTIN), "the built-ins first"
    assert sorted(out["names"][len(BUILTIN) :]) == ["broken-import", "double-one", "exits-at-import", "not-a-patch"]
    assert len(out["warnings"]) == 2 and all(m.startswith("patch pack tpack") for m in out["warnings"])
    assert out["loaded"] == [], "neither the packs' modules nor packaging: the gates wait for the targets"
    every = [
        "tpack_good.target",
        "tpack_import_error.target",
        "tpack_not_a_Patch.target",
        "tpack_exits_at_import.target",
    ]
    result = import_shim(tmp_path, targets=every)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["warnings"]) == 5, out["warnings"]
    assert out["states"] == {
        "broken-import": "failed",
        "double-one": "applied",
        "exits-at-import": "failed",
        "not-a-patch": "failed",
    }


def test_import_shim_without_a_pack_imports_no_pack_machinery():
    out = json.loads(import_shim(None).stdout)
    assert out["names"] == list(BUILTIN) and out["warnings"] == []
    assert "packaging.specifiers" not in out["loaded"]


def test_strict_import_shim_raises_for_a_refused_pack(tmp_path):
    write_pack(tmp_path, *CLAIMS["not a name"][:1])
    result = import_shim(tmp_path, SHIM_STRICT="1")
    assert result.returncode == 1
    assert "shim.settings.PatchError: patch pack tpack" in result.stderr and "(SHIM_STRICT=1)" in result.stderr


def test_a_pack_that_exits_at_import_never_ends_the_command(tmp_path):
    """The issue's case: a module-level argparse in a pack, under shim-run, with the shim on and
    switched off; and the same command without the shim."""
    entry_points, source, _ = BROKEN["exits at import"]
    name = write_pack(tmp_path, entry_points, source=source)
    command = ["-c", f"import {name}.target; print('training runs')", "--lr", "1"]
    env = clean_environment({"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])})
    runs = {
        "shim on": [sys.executable, "-m", "shim", "run", sys.executable, *command],
        "switched off": [sys.executable, "-m", "shim", "run", sys.executable, *command],
        "without the shim": [sys.executable, *command],
    }
    for how, argv in runs.items():
        extra = {"SHIM_DISABLE": "all"} if how == "switched off" else {}
        result = subprocess.run(argv, capture_output=True, text=True, env=env | extra, timeout=120)
        assert (result.returncode, result.stdout) == (0, "training runs\n"), (how, result.stderr)
        left_out = "entry point hf_train_shim.patches 'exits-at-import" in result.stderr
        assert left_out is (how == "shim on"), (how, result.stderr)


def test_a_pack_with_latin_1_metadata_never_breaks_the_import(tmp_path):
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, metadata=LATIN_1.replace(b"{name}", b"tpack-latin"))
    code = f"import {name}.target as t; print(t.one())"
    for env, said in (({}, 1), ({"SHIM_DISABLE": "all"}, 0)):  # switched off, the shim says nothing
        result = import_shim(tmp_path, "import shim\n" + code, **env)
        assert (result.returncode, result.stdout) == (0, "1\n"), result.stderr
        assert result.stderr.count("its METADATA is not UTF-8") == said
    result = import_shim(tmp_path, code)  # without the shim
    assert (result.returncode, result.stdout, result.stderr) == (0, "1\n", "")


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


def test_a_pack_text_reaches_the_terminal_escaped_and_the_json_as_it_is(tmp_path):
    source = GOOD.replace('summary="doubles one()"', 'summary="doubles \\x1b[31mone()\\x07"')
    name = write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, source=source)
    fixes = tmp_path / name / "fixes.py"
    fixes.write_text('"""A story \x1b[2J with a bell\x07."""\n' + fixes.read_text())
    env = clean_environment({"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])})
    for args in (["status"], ["explain"], ["explain", "double-one"], ["explain", "double-one", "--markdown"]):
        result = subprocess.run(
            [sys.executable, "-m", "shim", *args], capture_output=True, text=True, env=env, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout, args
        assert "\\x1b[31mone()\\x07" in result.stdout, args
    result = subprocess.run([sys.executable, "-m", "shim", "--json"], capture_output=True, text=True, env=env, cwd=ROOT)
    (record,) = [r for r in json.loads(result.stdout) if r["name"] == "double-one"]
    assert record["summary"] == "doubles \x1b[31mone()\x07" and record["provider"] == name.replace("_", "-")


def test_the_tools_report_a_broken_pack_and_never_crash_on_it(tmp_path):
    """A pack that fails at its module's import (a status row), and one refused at ``import shim``
    (no row: a note below the status table and in the report)."""
    entry_points, source, problem = BROKEN["exits at import"]
    write_pack(tmp_path, entry_points, source=source)
    refused, refusal = CLAIMS["not a name"]
    write_pack(tmp_path, refused)
    env = clean_environment({"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])})
    commands = {"status": 0, "doctor exits-at-import": 1, "explain exits-at-import": 0, "bug-report": 0}
    for command, code in commands.items():
        done = subprocess.run(
            [sys.executable, "-m", "shim", *command.split()], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == code and "Traceback" not in done.stderr, (command, done.stderr)
        assert problem in " ".join(done.stdout.split()), command
        if command in ("status", "bug-report"):
            assert "note: patch pack tpack" in done.stdout and refusal in " ".join(done.stdout.split()), command


# -- the one order, decided at import shim over every pack's record ----------------------------------

PLUS_ONE = GOOD.replace("2 * wrapped(*args, **kwargs)", "1 + wrapped(*args, **kwargs)").replace("doubled", "added")


def two_packs_on_one_target(tmp_path, monkeypatch, first_order=(), second_order=(), after=()):
    """Packs ``aaa-fix`` (adds 1, found first) and ``zzz-fix`` (doubles), both on ``aaa``'s target;
    ``after``: the names ``aaa-fix``'s Patch is declared after (its record says ``first_order``)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    source = PLUS_ONE.replace("bug_probe=", f"after={tuple(after)!r}, bug_probe=")
    first = write_pack(
        tmp_path, {"aaa-fix": "{n}.fixes:PATCH"}, name=f"a_first{next(_counter)}", order=first_order, source=source
    )
    second = write_pack(
        tmp_path,
        {"zzz-fix": "{n}.fixes:PATCH"},
        name=f"z_second{next(_counter)}",
        order=second_order,
        target=f"{first}.target",
    )
    return first, second


def test_a_pack_may_sit_after_a_pack_found_later_on_the_path(tmp_path, monkeypatch):
    first, _second = two_packs_on_one_target(
        tmp_path, monkeypatch, first_order=["aaa-fix.after.zzz-fix"], after=["zzz-fix"]
    )
    registry, held, warned = registered(tmp_path, builtin=False)
    assert warned == [] and [p.name for p in held] == ["zzz-fix", "aaa-fix"], "ordered over all records"
    registry.activate()
    target = __import__(f"{first}.target", fromlist=["one"])
    assert target.one() == 3, "aaa-fix sits outside zzz-fix: 1 + 2 * 1"
    assert {s.name: s.state for s in registry.status()} == {"zzz-fix": "applied", "aaa-fix": "applied"}
    registry.deactivate()


def test_a_pack_with_a_cyclic_after_is_refused_at_import_shim_and_never_imported(tmp_path, monkeypatch):
    first, second = two_packs_on_one_target(
        tmp_path, monkeypatch, first_order=["aaa-fix.after.zzz-fix"], second_order=["zzz-fix.after.aaa-fix"]
    )
    _registry, held, warned = registered(tmp_path, builtin=False)
    assert held == [] and len(warned) == 2
    assert all("its after= declarations form a cycle: aaa-fix -> zzz-fix -> aaa-fix" in m for m in warned)
    assert not {f"{first}.fixes", f"{second}.fixes"} & set(sys.modules)


def test_an_after_against_a_place_refuses_that_pack_alone(tmp_path, monkeypatch):
    first, second = two_packs_on_one_target(
        tmp_path, monkeypatch, first_order=["aaa-fix.place.innermost", "aaa-fix.after.zzz-fix"]
    )
    _registry, held, (message,) = registered(tmp_path, builtin=False)
    assert [p.name for p in held] == ["zzz-fix"] and message.startswith(message_of(first, "aaa-fix"))
    assert "its place ('innermost') and its after= 'zzz-fix'" in message and f"{first}.fixes" not in sys.modules


@pytest.mark.parametrize("other", ["not installed", "refused"])
def test_an_after_naming_a_missing_or_refused_pack_drops_that_constraint_not_the_pack(tmp_path, monkeypatch, other):
    order = ["aaa-fix.after.zzz-fix"]
    first, second = two_packs_on_one_target(tmp_path, monkeypatch, first_order=order, after=["zzz-fix"])
    if other == "not installed":
        for folder in tmp_path.glob(f"{second}-*.dist-info"):
            (folder / "entry_points.txt").write_text("")
    else:  # zzz-fix refused at import shim: it claims a place that does not exist
        entry_points = next(tmp_path.glob(f"{second}-*.dist-info")) / "entry_points.txt"
        entry_points.write_text(entry_points.read_text() + f"zzz-fix.place.sideways = {second}.fixes\n")
    registry, held, warned = registered(tmp_path, builtin=False)
    assert [p.name for p in held] == ["aaa-fix"] and len(warned) == (other == "refused")
    registry.activate()
    target = __import__(f"{first}.target", fromlist=["one"])
    (status,) = registry.status()
    gone = "is not installed" if other == "not installed" else "was refused"
    assert status.state == "applied" and target.one() == 2
    assert f"declared after 'zzz-fix', which {gone}: that constraint is dropped" in status.reason
    assert "sideways" not in status.reason, "its status shows its own problem, never another's"
    registry.deactivate()


def test_a_stale_target_list_is_said_wherever_the_module_is_loaded(tmp_path, monkeypatch):
    # The list names a module the Patch does not target: the real target is imported, the listed
    # one never is; the first status loads the module, and says so.
    registry, name = activated(tmp_path, monkeypatch)
    fixes = tmp_path / name / "fixes.py"
    fixes.write_text(fixes.read_text().replace('TARGET + ":one"', '"json:dumps"'))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (status,) = registry.status()
    (message,) = said(caught)
    assert f"its record lists the target modules {name}.target, its Patch targets json" in message
    assert "run python -m shim index in the pack and reinstall it" in message and message in status.reason
    registry.deactivate()


#: The GOOD pack, importing its own target at its top.
SELF_IMPORTING = GOOD.replace(
    "record_effect\n", "record_effect\nfrom {n} import target  # the pack imports its own target at its top\n", 1
)


@pytest.mark.parametrize("when", ["after import shim", "before import shim"])
def test_a_pack_module_importing_its_own_target_applies_before_the_first_call(tmp_path, when):
    name = f"selfish{next(_counter)}"
    write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, name=name, source=SELF_IMPORTING.replace("{n}", name))
    first = (
        f"from {name} import fixes\nimport shim"
        if when == "before import shim"
        else f"import shim\nfrom {name} import fixes"
    )
    code = f"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {first.replace(chr(10), chr(10) + "    ")}
    from {name} import target
    first_call = target.one()
    states = {{s.name: s.state for s in shim.status()}}
print(json.dumps({{"state": states.get("double-one"), "one": first_call,
                  "warnings": [str(w.message) for w in caught if "patch pack" in str(w.message)]}}))
"""
    result = import_shim(tmp_path, code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"state": "applied", "one": 2, "warnings": []}


# -- off is off: SHIM_DISABLE=all says nothing of a pack left out; status and doctor say it ---------

LEFT_OUT = """
import json
import shim
{name}.target.one()
print(json.dumps(shim.registry.left_out))
"""


def test_switched_off_the_shim_says_nothing_of_the_packs_it_left_out_and_status_still_does(tmp_path):
    """Two packs whose after= declarations form a cycle, and one whose METADATA is not UTF-8: with the
    shim on, one warning each at ``import shim``; with ``SHIM_DISABLE=all`` nothing at import or
    exit, not even under ``-W error`` or ``SHIM_STRICT=1`` (a third party's broken pack must not break
    a run with everything off); ``python -m shim`` says each below its table either way."""
    first = write_pack(
        tmp_path, {"aaa-fix": "{n}.fixes:PATCH"}, name=f"a_first{next(_counter)}", order=["aaa-fix.after.zzz-fix"]
    )
    write_pack(tmp_path, {"zzz-fix": "{n}.fixes:PATCH"}, name=f"z_second{next(_counter)}", order=["zzz-fix.after.aaa-fix"],
               target=f"{first}.target")  # fmt: skip
    write_pack(tmp_path, {"double-one": "{n}.fixes:PATCH"}, metadata=LATIN_1.replace(b"{name}", b"tpack-latin"))
    env = clean_environment({"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])})
    code = LEFT_OUT.format(name=f"import {first}.target;{first}")

    def run(*options, **switches):
        argv = [sys.executable, *options, "-c", code]
        return subprocess.run(argv, capture_output=True, text=True, env=env | switches, cwd=ROOT, timeout=120)

    on = run()
    assert on.returncode == 0, on.stderr
    left_out = json.loads(on.stdout)
    assert len(left_out) == 3 and sum("form a cycle" in message for message in left_out) == 2, left_out
    assert [on.stderr.count(message) for message in left_out] == [1, 1, 1], on.stderr
    for switches in ({"SHIM_DISABLE": "all"}, {"SHIM_DISABLE": "all", "SHIM_STRICT": "1"}):
        for options in ((), ("-W", "error")):
            off = run(*options, **switches)
            assert (off.returncode, off.stderr) == (0, ""), (switches, options, off.stderr)
            assert json.loads(off.stdout) == left_out, "kept for status and doctor"
    for switches in ({}, {"SHIM_DISABLE": "all"}):
        status = subprocess.run(
            [sys.executable, "-m", "shim", "--wide"], capture_output=True, text=True, env=env | switches, timeout=120
        )
        assert status.returncode == 0, status.stderr
        assert all(f"note: {message}" in status.stdout for message in left_out), status.stdout
