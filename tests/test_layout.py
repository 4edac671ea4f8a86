"""The code layout a contributor relies on, read from the imports: small engine modules with no
import circle, and patches that use only the engine's public API."""

import ast

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.any_version  # the code as it is, whatever is installed

ENGINE = ROOT / "shim"
#: What a patch module may import of the engine: the package's API (Patch, Target, record_effect,
#: switch_of) and the shared tiny models and the steps taken on them.
PUBLIC = {"shim", "shim.tinymodels", "shim.tinysteps"}


def imports(path) -> set[str]:
    """Every module ``path`` imports, also inside functions and ``if TYPE_CHECKING:``, resolved
    to absolute names (``from . import x`` in ``shim`` reads as ``shim.x``)."""
    package = "shim" if path.parent == ENGINE else "shim.patches"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            if node.module is None or (node.level and module == package):
                found.update(f"{module}.{alias.name}" for alias in node.names)
            else:
                found.add(module)
    return found


def engine_graph() -> dict[str, set[str]]:
    modules = {f"shim.{path.stem}": path for path in ENGINE.glob("*.py") if path.stem != "__init__"}
    return {name: {m for m in imports(path) if m in modules} for name, path in modules.items()}


def test_no_engine_module_is_over_250_lines():
    long = {path.name: n for path in ENGINE.glob("*.py") if (n := len(path.read_text().splitlines())) > 250}
    assert long == {}


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
