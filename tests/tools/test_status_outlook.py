"""``python -m shim`` as a new user runs it, in a fresh interpreter that has imported no target: one
summary line first, then for each patch what its import will do (``will apply`` / ``will skip``), as
the gates decide it when the targets are imported; the effects column only once a patch has acted."""

import json
import os

import pytest

import shim
from shim import Registry
from shim.patches import INDEX
from shim.tools import outlook
from shim.tools.render import status_table, summary
from tests.conftest import ROOT, python_m_shim
from tests.engine.fakes import make_patch

pytestmark = pytest.mark.any_version  # the prediction is checked against the import, whatever is installed

BUILTINS = sorted(row["name"] for row in INDEX)


def cli(*args: str, env: dict | None = None) -> str:
    return python_m_shim(*args, env=env, timeout=300).stdout


def rows(shown: str) -> dict[str, str]:
    """``{patch: state}`` from the status table (a state may be two words: ``will apply``)."""
    lines = shown.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("patch ")) + 2 :]
    found = {}
    for line in table:
        words = line.split()
        if words and words[0] in BUILTINS:
            found[words[0]] = " ".join(words[1:3]) if words[1] == "will" else words[1]
    return found


def test_what_a_fresh_status_says_will_apply_is_what_the_import_does():
    """Before: nothing imported, ``will apply`` / ``will skip`` / ``skipped``; after importing every
    target module: ``applied`` exactly where it said ``will apply``, and the same summary line."""
    before, after = cli(), cli("--import-targets")
    predicted, imported = rows(before), rows(after)
    assert list(predicted) == BUILTINS == list(imported), "one row per patch, by name"
    assert "pending" not in predicted.values()
    for name in BUILTINS:
        expected = {"will apply": "applied", "will skip": "skipped"}.get(predicted[name], predicted[name])
        assert imported[name] == expected, (name, predicted[name], imported[name])
    assert before.split("\n\n")[0] == after.split("\n\n")[0], "the summary line, before and after"
    assert before.splitlines()[0].startswith(f"{sum(s == 'will apply' for s in predicted.values())} of ")
    assert "effects" not in before.splitlines()[2], "no effects column where nothing acted"


@pytest.fixture
def older_releases(tmp_path):
    """transformers 5.0.0 and trl 0.25.1 as the installed metadata says them (dist-info folders ahead
    on sys.path): what the gates read before the libraries are imported."""
    for name, version in (("transformers", "5.0.0"), ("trl", "0.25.1")):
        folder = tmp_path / f"{name}-{version}.dist-info"
        folder.mkdir()
        (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}


def test_a_patch_whose_targets_need_other_releases_will_skip_and_says_what_they_need(older_releases):
    shown = cli("--wide", env=older_releases)
    states = rows(shown)
    # Its gate (transformers>=4.57) admits 5.0.0, but none of its targets: trl>=0.26,
    # transformers>=5.16,<5.23 and transformers>=5.23.
    assert states["checkpointing-call-signature"] == "will skip"
    lines = shown.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("checkpointing-call-signature "))
    reason = next(line for line in lines[row:] if line.startswith("    reason: "))
    assert reason.strip().startswith("reason: no target of it is for the installed releases: ")
    assert "trl 0.25.1 is outside >=0.26" in reason and "transformers 5.0.0 is outside >=5.16,<5.23" in reason
    assert states["load-keeps-requires-grad"] == "will apply"  # transformers>=5.0
    assert states["checkpointing-args-aliases"] == "skipped"  # its gate, transformers>=5.23, leaves 5.0.0 out
    summary = shown.splitlines()[0]
    assert "outside their versions: " in summary and "checkpointing-call-signature" in summary.split("outside")[1]
    records = json.loads(cli("--json", env=older_releases))
    assert [record["name"] for record in records] == BUILTINS, "--json: the records, by name"
    assert {r["name"]: r["state"] for r in records}["checkpointing-call-signature"] == "pending", (
        "--json keeps its shape"
    )


def test_the_outlook_of_made_up_patches(fake_modules):
    pkg = fake_modules(target="def f():\n    return 1\n")  # installed 1.2.0, target not imported
    registry = Registry(
        [
            make_patch(pkg, name="applies"),
            make_patch(pkg, name="outside", requires=">=2.0"),
            make_patch("not_installed_anywhere", name="missing"),
            make_patch(pkg, name="opted-out"),
        ]
    )
    registry.activate()
    registry.disable("opted-out")
    records = registry.status()
    seen = outlook.outlooks(records, registry)
    assert {name: (found.kind, found.state) for name, found in seen.items()} == {
        "applies": (outlook.APPLIES, outlook.WILL_APPLY),
        "outside": (outlook.OUTSIDE, "skipped"),
        "missing": (outlook.NOT_INSTALLED, "skipped"),
        "opted-out": (outlook.OPTED_OUT, "disabled"),
    }
    assert summary(records, seen) == (
        "1 of 4 patches applies to the installed releases; 1 outside its versions: outside; "
        "1 needs a library that is not installed: missing; 1 opted out: opted-out"
    )


def test_the_effects_column_shows_once_a_patch_has_acted():
    records = sorted(shim.status(), key=lambda record: record.name)
    quiet = [record.__class__(**{**record.__dict__, "effects": 0}) for record in records]
    assert status_table(quiet).splitlines()[0].split() == ["patch", "state", "installed"]
    acted = [quiet[0].__class__(**{**quiet[0].__dict__, "effects": 3}), *quiet[1:]]
    table = status_table(acted).splitlines()
    assert table[0].split() == ["patch", "state", "installed", "effects"]
    assert table[2].split()[-1] == "3"


def test_a_build_the_shim_was_not_measured_on_will_probe_and_a_patch_that_steps_aside_is_counted(
    fake_modules, monkeypatch
):
    """A dev build: a pending patch's state says its bug probe decides at the import; once decided, the
    patch whose probe found no bug is counted apart in the summary, and doctor calls it fixed upstream."""
    import importlib

    from shim.tools import doctor
    from tests.engine.fakes import finds

    pkg = fake_modules(target="def f():\n    return 1\n")
    monkeypatch.setattr(importlib.import_module(pkg), "__version__", "1.3.0.dev0")
    registry = Registry(
        [
            make_patch(pkg, name="has-the-bug", bug_probe=finds(True)),
            make_patch(pkg, name="fixed", bug_probe=finds(False)),
        ]
    )
    registry.activate()
    seen = outlook.outlooks(registry.status(), registry)
    assert {name: found.state for name, found in seen.items()} == {"has-the-bug": "will probe", "fixed": "will probe"}
    assert f"its bug probe decides at the import: {pkg} 1.3.0.dev0 is a build between releases" in seen["fixed"].reason
    importlib.import_module(f"{pkg}.target")
    records = registry.status()
    seen = outlook.outlooks(records, registry)
    assert (seen["fixed"].kind, seen["has-the-bug"].kind) == (outlook.FIXED_UPSTREAM, outlook.APPLIES)
    assert summary(records, seen) == (
        "1 of 2 patches applies to the installed releases; "
        "1 fixed upstream (its bug probe found the fix: it steps aside): fixed"
    )
    verdicts = {finding.name: finding.verdict for finding in doctor.run(registry)}
    assert verdicts == {"fixed": doctor.FIXED_UPSTREAM, "has-the-bug": doctor.NOT_FIXED}  # its wrapper fixes nothing
