"""The catalogue as it ships: installed as ``shim.patches``, indexed, imported only when needed."""

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import shim
from shim import patches as catalogue
from tests.conftest import ROOT, run_python, zygote

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


def test_the_index_is_generated_from_each_patch_modules_declaration():
    modules = sorted(path.stem for path in (ROOT / "patches").glob("*.py") if not path.stem.startswith("_"))
    assert sorted(row["module"] for row in catalogue.INDEX) == modules, "every patch module is listed, once"
    for row in catalogue.INDEX:
        patch = importlib.import_module(f"shim.patches.{row['module']}").PATCH
        declared = (
            dict(name=patch.name, distribution=patch.distribution, requires=patch.requires, modules=patch.modules)
            | ({"place": patch.place} if patch.place else {})
            | ({"after": patch.after} if patch.after else {})
        )
        assert {k: v for k, v in row.items() if k != "module"} == declared, row["module"]
    assert shim.registry.names[: len(catalogue.INDEX)] == tuple(row["name"] for row in catalogue.INDEX)
    # The index block is exactly what the generator writes (python -m shim index).
    result = subprocess.run(
        [sys.executable, "-m", "shim", "index", "--check"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


def test_patches_on_one_target_run_in_the_order_of_the_index():
    """However many patches wrap a target, the engine's one layer there runs their parts in the
    catalogue's one order: ``shim.wrappers`` lists them outermost first, the index innermost first."""
    from shim.tools.index import declared

    patches = declared()
    order = [patch.name for patch in patches]
    by_target: dict = {}
    for patch in patches:
        for target in patch.targets:
            by_target.setdefault(target.spec, []).append(patch.name)
    shared = {spec: names for spec, names in by_target.items() if len(names) > 1}
    assert len(shared) >= 4, "the catalogue has targets several patches wrap; this test must see them"
    for spec, names in shared.items():
        assert names == sorted(names, key=order.index), spec  # declared() lists them in the index's order
        listed = [name for name, _layer in shim.wrappers(spec)]
        if listed:  # its module is imported and the patches apply here
            assert listed == sorted(listed, key=order.index, reverse=True), spec
            assert len({id(layer) for _name, layer in shim.wrappers(spec)}) == 1, spec


def test_finds_layer_acts_last_on_the_checkpointing_path_by_its_place():
    """``checkpoint-function-finds-layer`` hands over last because it says so (``place="innermost"``),
    not by naming the steps before it: a step added later without naming it still acts before it."""
    from shim.tools.index import declared

    by_name = {patch.name: patch for patch in declared()}
    assert by_name["checkpoint-function-finds-layer"].place == "innermost"
    assert by_name["checkpoint-function-finds-layer"].after == ()
    assert [row["name"] for row in catalogue.INDEX][0] == "checkpoint-function-finds-layer"


def test_the_stacking_order_follows_after_and_refuses_cycles():
    from shim import Patch, Target
    from shim.tools.index import stacking_order

    def patch(name, *after):
        return Patch(name, "s", "demo", ">=1", (Target("m:f", lambda *a: None),), after=after)

    ordered = stacking_order([patch("c"), patch("a", "c"), patch("d", "a"), patch("b")])
    assert [p.name for p in ordered] == ["b", "c", "a", "d"]  # in rounds, each by name
    with pytest.raises(ValueError, match="cycle"):
        stacking_order([patch("a", "b"), patch("b", "a")])
    with pytest.raises(ValueError, match="no built-in patch"):
        stacking_order([patch("a", "missing")])


def test_import_shim_after_transformers_imports_no_patch_module_no_wrapt_no_packaging_specifiers():
    code = """
    import json, sys
    import transformers
    import shim
    print(json.dumps({
        "patch_modules": sorted(m for m in sys.modules if m.startswith("shim.patches.")),
        "shim.checkpointing": "shim.checkpointing" in sys.modules,
        "packaging.specifiers": "packaging.specifiers" in sys.modules,
        "wrapt": "wrapt" in sys.modules,
        "states": sorted({s.state for s in shim.status()}),
    }))
    """
    out = json.loads(run_python(code, torch_first=True).stdout.strip().splitlines()[-1])
    assert out["patch_modules"] == [] and out["packaging.specifiers"] is False and out["wrapt"] is False
    assert out["shim.checkpointing"] is False, "only a patch module with a step imports the checkpointing path"
    # shim.status() then reads the modules for their summaries: it imports them, applies nothing.
    assert "applied" not in out["states"]


TARGETS = (
    "transformers.modeling_utils",
    "transformers.modeling_layers",
    "transformers.core_model_loading",
    "trl.models.utils",
)
USER_SCRIPT = (
    f"TARGETS = {TARGETS!r}\nMINE = {{mine}}\n"
    + """
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    if MINE:
        import patches  # the project's own module, beside this script
    import shim
    import importlib, importlib.util
    for name in TARGETS:
        if importlib.util.find_spec(name) is not None:  # core_model_loading exists from transformers 5.0
            importlib.import_module(name)
print(json.dumps({
    "user_patches": patches.__file__ if MINE else None,
    "catalogue": shim.patches.__name__,
    "states": {s.name: s.state for s in shim.status()},
    "warnings": [str(w.message) for w in caught if "shim" in str(w.filename) or issubclass(w.category, shim.ShimWarning)],
}))
"""
)


def run_user_script(folder: Path, mine: bool) -> dict:
    """USER_SCRIPT as ``python train.py`` in ``folder``, as a user runs it (no PYTHONPATH), forked
    from an interpreter that has imported torch (nothing here depends on torch's import)."""
    result = zygote().run(USER_SCRIPT.replace("{mine}", str(mine)), timeout=300, folder=str(folder))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain_states(tmp_path_factory):
    """The states of the same script in a folder with no patches of its own (run once for both layouts)."""
    return run_user_script(tmp_path_factory.mktemp("plain"), mine=False)["states"]


@pytest.mark.parametrize("layout", ["package", "module"])
def test_a_users_own_patches_module_beside_the_script_changes_nothing(tmp_path, layout, plain_states):
    if layout == "package":
        (tmp_path / "patches").mkdir()
        (tmp_path / "patches" / "__init__.py").write_text("MINE = True\n")
    else:
        (tmp_path / "patches.py").write_text("MINE = True\n")
    out = run_user_script(tmp_path, mine=True)
    assert Path(out["user_patches"]).resolve().parent in (tmp_path.resolve(), (tmp_path / "patches").resolve())
    assert out["catalogue"] == "shim.patches"
    assert out["warnings"] == []
    assert out["states"] == plain_states and set(plain_states) == {row["name"] for row in catalogue.INDEX}
    assert "applied" in plain_states.values()


def test_the_wheel_installs_only_the_shim_package(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("shim", "patches", "docs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("hf_train_shim-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = next(n for n in names if n.endswith("top_level.txt"))
        assert archive.read(top_level).decode().split() == ["shim"]
    packages = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert packages == {"shim"}
    for row in catalogue.INDEX:
        assert f"shim/patches/{row['module']}.py" in names
    assert "shim/py.typed" in names
    for module in ("__init__", "path", "function"):  # the public checkpointing path, shim.checkpointing
        assert f"shim/checkpointing/{module}.py" in names
    assert "shim/tools/_sitecustomize/sitecustomize.py" in names  # shim-run's start-up directory
    assert [name for name in names if name.startswith("shim/docs/")] == ["shim/docs/bugs.md"]  # explain's text
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "shim-run = shim.tools.run:main" in entry_points


def test_without_the_catalogue_the_shim_warns_and_still_imports(tmp_path):
    # A clone put on sys.path without installing it: shim/ is found, shim.patches is not.
    shutil.copytree(ROOT / "shim", tmp_path / "shim", ignore=shutil.ignore_patterns("__pycache__"))
    code = textwrap.dedent(
        f"""
        import sys, warnings
        sys.path.insert(0, {str(tmp_path)!r})
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", ""))]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import shim
        print(shim.__file__.startswith({str(tmp_path)!r}), shim.status(), [str(w.message) for w in caught])
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("True [] ")
    assert "catalogue shim.patches cannot be imported" in result.stdout and "pip install -e ." in result.stdout


def test_no_patch_wraps_a_modules_call_or_forward():
    """A fix sits where the bug is, never on the hot call path of a module: a call that cannot need a
    fix must run no code of the shim (and torch.compile must see stock classes)."""
    from shim.tools.index import declared

    on_call_path = [
        f"{patch.name}: {target.spec}"
        for patch in declared()
        for target in patch.targets
        if target.path.rpartition(".")[2] in ("__call__", "forward", "_call_impl", "_wrapped_call_impl")
    ]
    assert on_call_path == []
