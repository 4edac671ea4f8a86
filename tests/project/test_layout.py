"""The code layout a contributor relies on, read from the imports: an engine that never imports
the tools, no import circle, and patches that use only the engine's public API."""

import ast

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.any_version  # the code as it is, whatever is installed

ENGINE = ROOT / "shim"
#: What a patch module may import of the engine: the package's API (Patch, Target, record_effect,
#: switch_of, wrappers) and the shared tiny models and the steps taken on them.
PUBLIC = {"shim", "shim.selfcheck", "shim.selfcheck.models", "shim.selfcheck.steps"}


def imports(path) -> set[str]:
    """Every module ``path`` imports, also inside functions and ``if TYPE_CHECKING:``, resolved
    to absolute names (``from . import x`` in ``shim`` reads as ``shim.x``)."""
    relative = path.parent.relative_to(ROOT).parts
    package = "shim.patches" if relative == ("patches",) else ".".join(relative)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            if node.module is None:
                found.update(f"{module}.{alias.name}" for alias in node.names)
            else:
                found.add(module)
    return found


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def shim_graph() -> dict[str, set[str]]:
    """Each module of the ``shim`` package (the wings included) -> the modules of it that it imports."""
    modules = {module_name(path): path for path in ENGINE.rglob("*.py") if "_sitecustomize" not in path.parts}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for imported in imports(path):
            while imported and imported not in modules:  # "from shim.tools import cli" -> shim.tools.cli
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return graph


def engine_graph() -> dict[str, set[str]]:
    """The engine's modules (the top level of ``shim``) -> the engine modules each imports."""
    graph = shim_graph()
    engine = {name for name in graph if name.count(".") == 1}
    return {name: graph[name] & engine for name in engine}


#: The user's tools (CLI, doctor, tables, exit report, launcher) and the self-checks' tiny models
#: and steps, each in its own wing: built on the engine, never imported by it (``import shim`` stays
#: small, and a tool can change without touching what runs in a training process). Only the
#: package's front door may reach them, lazily: ``shim.report()`` and ``SHIM_REPORT=1``.
WINGS = ("shim.tools", "shim.selfcheck")
FRONT_DOOR = {"shim", "shim.__main__"}


def test_the_engine_never_imports_the_tools_nor_the_self_checks():
    graph = shim_graph()
    assert {"shim.tools.cli", "shim.tools.doctor", "shim.selfcheck.models"} <= set(graph), "where this test looks"

    def in_wing(name):
        return name in WINGS or name.startswith(tuple(f"{wing}." for wing in WINGS))

    offenders = {
        name: sorted(filter(in_wing, imported))
        for name, imported in graph.items()
        if not in_wing(name) and name not in FRONT_DOOR
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_wings_sit_beside_the_engine():
    """The top level of ``shim`` is the engine (what ``import shim`` may load); the tools and the tiny
    models live in their wings."""
    top = sorted(path.name for path in ENGINE.glob("*.py"))
    wings = sorted(path.name for path in ENGINE.iterdir() if (path / "__init__.py").is_file())
    assert wings == ["selfcheck", "tools"]
    assert not {"cli.py", "doctor.py", "run.py", "tinymodels.py"} & set(top)
    # A room per job of the engine, not a file per helper: a reader takes in the engine at a glance.
    assert len(top) <= 12, f"the engine's top level has {len(top)} modules: {top}"


def test_the_engine_has_no_import_circle():
    graph = engine_graph()
    assert graph["shim.registry"] >= {"shim.entry", "shim.records"}, "the graph must see the imports"

    def visit(module, path):
        assert module not in path, f"import circle: {' -> '.join([*path[path.index(module) :], module])}"
        for imported in graph[module]:
            visit(imported, [*path, module])

    for module in graph:
        visit(module, [])


def test_patches_use_only_the_engines_public_api():
    offenders = []
    for path in sorted((ROOT / "patches").glob("*.py")):
        if path.name == "__main__.py":  # the index generator, a development tool
            continue
        for module in imports(path):
            private = module.startswith("shim.") and not module.startswith("shim.patches")
            if private and module not in PUBLIC:
                offenders.append(f"{path.name}: {module}")
    assert offenders == []
