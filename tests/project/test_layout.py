"""The code layout a contributor relies on, read from the imports: an engine that never imports
the tools, no import circle, and patches that use only the engine's public API."""

import ast

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.any_version  # the code as it is, whatever is installed

ENGINE = ROOT / "shim"
#: What a patch module may import of the engine: the package's API (Patch, Target, record_effect,
#: switch_of, wrappers, BugProbe, Evidence), the checkpointing path's API, and the bug probes' bare models.
PUBLIC = {"shim", "shim.checkpointing", "shim.selfcheck", "shim.selfcheck.bare"}


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
    """Each module of the ``shim`` package (the wings included) -> the modules of it that it imports.
    A patch module (``shim.patches.*``, from patches/) is none of them: it is built on the front door."""
    modules = {module_name(path): path for path in ENGINE.rglob("*.py") if "_sitecustomize" not in path.parts}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for imported in imports(path):
            if imported == "shim.patches" or imported.startswith("shim.patches."):
                continue
            while imported and imported not in modules:  # "from shim.tools import cli" -> shim.tools.cli
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return graph


def engine_graph() -> dict[str, set[str]]:
    """The engine's rooms (the top level of ``shim``) -> the rooms each imports. A room that is a
    package (``shim.checkpointing``) is its modules together; a wing is its front module alone."""
    graph = shim_graph()
    engine = {name for name in graph if name.count(".") == 1}

    def room(name: str) -> str:
        top = ".".join(name.split(".")[:2])
        return top if top in engine and top not in WINGS else name

    rooms = {name: set() for name in engine}
    for name, imported in graph.items():
        if room(name) in rooms:
            rooms[room(name)] |= ({room(module) for module in imported} & engine) - {room(name)}
    return rooms


#: The user's tools (CLI, doctor, tables, exit report, launcher) and the bug probes' bare models,
#: each in its own wing: built on the engine, never imported by it (``import shim`` stays
#: small, and a tool can change without touching what runs in a training process). Only the
#: package's front door may reach them, lazily: ``shim.report()`` and ``SHIM_REPORT=1``.
WINGS = ("shim.tools", "shim.selfcheck")
FRONT_DOOR = {"shim", "shim.__main__"}


def test_the_engine_never_imports_the_tools_nor_the_self_checks():
    graph = shim_graph()
    assert {"shim.tools.cli", "shim.tools.doctor", "shim.selfcheck.bare"} <= set(graph), "where this test looks"

    def in_wing(name):
        return name in WINGS or name.startswith(tuple(f"{wing}." for wing in WINGS))

    offenders = {
        name: sorted(filter(in_wing, imported))
        for name, imported in graph.items()
        if not in_wing(name) and name not in FRONT_DOOR
    }
    assert {name: found for name, found in offenders.items() if found} == {}


#: The engine's rooms, each with the rooms it may import (also lazily, also for type checking):
#: the direction of every arrow in docs/how-it-works.md. A room below never reaches one above it,
#: and a new room must be placed here.
ROOMS = {
    "shim.settings": set(),  # the environment variables, PatchError, ShimWarning
    "shim.forks": set(),  # locks that survive os.fork()
    # the one order of the parts on a target (Patch.after, Patch.place) and what it must refuse, one
    # function for the index, the packs at import shim and register()
    "shim.order": set(),
    "shim.ranges": set(),  # how a version range, a run of numbers and a list of names are written
    "shim.patch": {"shim.settings", "shim.order"},  # a patch's declaration
    # switches and the effects ledger, and where a worker's counts go (the exit report's keys, which
    # the front door sets and the tools read: no tool reaches into the front door for them)
    "shim.runtime": {"shim.forks"},
    "shim.importhooks": {"shim.forks"},  # post-import hooks and their finder
    "shim.parts": {"shim.runtime"},  # the parts in one target's layer, and which act now
    # the checkpointing path, public: the steps' targets and what a step uses; built on the front
    # door as a patch is (settings: a faulty step's one warning), and imported only by patch modules
    # with a step, never by the engine
    "shim.checkpointing": {"shim.patch", "shim.runtime", "shim.settings"},
    "shim.assigning": {"shim.parts"},  # an assign target's layer
    "shim.wrapping": {"shim.assigning", "shim.parts"},  # the layer in one target
    "shim.rebinding": set(),  # consumers' copies of a target
    "shim.layers": {"shim.wrapping", "shim.rebinding", "shim.parts", "shim.runtime", "shim.patch"},  # one patch's parts
    # every patch's record, read before its module is imported, and the one step that imports it
    "shim.catalogue": {"shim.patch", "shim.settings", "shim.order", "shim.importhooks"},
    "shim.others": {"shim.wrapping", "shim.layers", "shim.patch", "shim.catalogue"},  # other patchers, named when asked
    "shim.gating": {
        "shim.wrapping",
        "shim.assigning",
        "shim.layers",
        "shim.patch",
        "shim.ranges",
        "shim.catalogue",
    },  # whether a patch applies: versions, gates, target requirements, shape checks
    # the bug probes' life: when one is asked, waiting for what it needs, asking it without a trace,
    # and what its answer does to the gate and the targets (the entry asks it)
    "shim.probing": {"shim.gating", "shim.layers", "shim.patch", "shim.ranges", "shim.runtime", "shim.settings"},
    "shim.entry": {
        "shim.gating",
        "shim.probing",
        "shim.layers",
        "shim.others",
        "shim.runtime",
        "shim.patch",
        "shim.settings",
        "shim.order",
        "shim.ranges",
        "shim.catalogue",
    },  # one patch's life
    "shim.statuses": {
        "shim.entry",
        "shim.gating",
        "shim.others",
        "shim.runtime",
        "shim.patch",
        "shim.ranges",
        "shim.catalogue",
    },  # fmt: skip  # a patch's status, read from its entry
    # the first-step audit's findings and their wording: kept, warned, the exit line, what in_effect says
    "shim.findings": {"shim.settings", "shim.ranges"},
    # the first-step audit's watch: at a model's first optimizer step, what ran and what got a gradient
    "shim.audit": {"shim.findings", "shim.importhooks", "shim.settings"},
    "shim.packs": {"shim.catalogue", "shim.settings", "shim.order", "shim.registry"},  # other distributions' records
    "shim.registry": {
        "shim.entry",
        "shim.statuses",
        "shim.others",
        "shim.importhooks",
        "shim.order",
        "shim.forks",
        "shim.runtime",
        "shim.patch",
        "shim.settings",
        "shim.catalogue",
    },  # fmt: skip
}
#: The front door (the public API) and ``python -m shim`` may import any room.
FRONT = {"shim", "shim.__main__"}


def test_the_wings_sit_beside_the_engine():
    """The top level of ``shim`` is the engine (what ``import shim`` may load); the tools and the tiny
    models live in their wings. The one other package is a room, the public checkpointing path."""
    top = sorted(path.name for path in ENGINE.glob("*.py"))
    packages = sorted(path.name for path in ENGINE.iterdir() if (path / "__init__.py").is_file())
    assert packages == ["checkpointing", "selfcheck", "tools"]
    assert [package for package in packages if f"shim.{package}" not in WINGS] == ["checkpointing"]
    assert not {"cli.py", "doctor.py", "run.py", "tinymodels.py"} & set(top)


def test_only_patch_modules_import_the_checkpointing_path():
    """``import shim`` never loads ``shim.checkpointing``: neither the front door nor a room nor a wing
    imports it; a patch module with a step does (a built-in's once its target module is imported)."""
    graph = shim_graph()
    assert {"shim.checkpointing", "shim.checkpointing.path"} <= set(graph), "where this test looks"

    def on_the_path(name):
        return name == "shim.checkpointing" or name.startswith("shim.checkpointing.")

    importers = sorted(
        name for name, imported in graph.items() if not on_the_path(name) and any(map(on_the_path, imported))
    )
    assert importers == []


def test_every_room_imports_only_the_rooms_below_it():
    graph = engine_graph()
    rooms = set(graph) - FRONT - {"shim.tools", "shim.selfcheck"}
    assert rooms == set(ROOMS), "a room is missing from ROOMS, or ROOMS names one that is gone"
    assert graph["shim.registry"] >= {"shim.entry", "shim.statuses"}, "the graph must see the imports"
    upward = {room: sorted(graph[room] - allowed) for room, allowed in ROOMS.items() if graph[room] - allowed}
    assert upward == {}


def test_the_bug_probes_life_is_one_room_that_only_the_entry_asks():
    """When a bug probe is asked, waiting for what it needs, asking it and what its answer decides
    live in ``shim.probing``; of the engine's rooms only a patch's entry reaches it (a status reads
    the entry)."""
    graph = engine_graph()
    assert sorted(room for room, imported in graph.items() if "shim.probing" in imported) == ["shim.entry"]

    def defined(room: str) -> set[str]:
        tree = ast.parse((ENGINE / f"{room}.py").read_text())
        return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}

    life = {"why_asked", "Probes", "Answer", "ask", "_traceless", "_importable"}
    assert life <= defined("probing")
    assert {room: defined(room) & life for room in ("entry", "gating", "statuses")} == {
        "entry": set(),
        "gating": set(),
        "statuses": set(),
    }


def test_the_rooms_drawing_is_the_import_graph():
    """docs/how-it-works.md draws every import between the engine's rooms, but those of the leaves."""
    import re

    text = (ROOT / "docs" / "how-it-works.md").read_text()
    drawing = text.split("### The engine's rooms", 1)[1].split("```mermaid", 1)[1].split("```", 1)[0]
    drawn = set(re.findall(r"^\s*(\w+) --> (\w+)$", drawing, re.MULTILINE))
    leaves = {"patch", "settings", "order", "ranges"}
    graph = engine_graph()
    real = {
        (room.removeprefix("shim."), imported.removeprefix("shim."))
        for room in ROOMS
        for imported in graph[room]
        if imported.removeprefix("shim.") not in leaves
    }
    assert drawn == real


def assert_no_circle(graph: dict[str, set[str]]) -> None:
    """No module of ``graph`` (module -> the modules it imports) reaches itself again."""

    def visit(module, path):
        assert module not in path, f"import circle: {' -> '.join([*path[path.index(module) :], module])}"
        for imported in graph.get(module, ()):
            visit(imported, [*path, module])

    for module in graph:
        visit(module, [])


def test_the_engine_has_no_import_circle():
    graph = engine_graph()
    assert graph["shim.registry"] >= {"shim.entry", "shim.statuses"}, "the graph must see the imports"
    assert_no_circle(graph)


def test_the_wings_have_no_import_circle():
    """Within a wing too, each module imports only modules that do not import it back (also lazily,
    also for type checking): the tables and lines the tools print live in ``shim.tools.render``,
    which the commands, the bug report and the exit report import, never the other way round."""
    graph = shim_graph()
    wings = {
        name: {module for module in graph[name] if module.startswith(name.rpartition(".")[0] + ".")} for name in graph
    }
    wings = {name: imported for name, imported in wings.items() if name.startswith(tuple(f"{w}." for w in WINGS))}
    assert {"shim.tools.cli", "shim.tools.bugreport", "shim.tools.render"} <= set(wings), "where this test looks"
    assert "shim.tools.render" in wings["shim.tools.bugreport"] & wings["shim.tools.cli"], (
        "the graph must see the imports"
    )
    assert_no_circle(wings)


def test_the_package_has_no_import_circle():
    """Across the front door, the rooms and the wings too (also lazily): the front door imports the
    exit report's tools at exit, and they take what they share with it (the workers' key, the Ray
    job's variable) from a room below both, ``shim.runtime``."""
    graph = shim_graph()
    assert "shim.tools.report" in graph["shim"], "the graph must see the front door's lazy imports"
    assert_no_circle(graph)


def private_names_of_shim(path) -> list[str]:
    """The private names of the ``shim`` package (its front door) that ``path`` imports or reads:
    ``from .. import _KEY`` in a module of ``shim.tools``, ``shim._KEY``, ``sys.modules["shim"]._KEY``."""
    package = ".".join(path.parent.relative_to(ROOT).parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            if ".".join(filter(None, [base, node.module])) == "shim":
                found += [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute):
            held = node.value
            if isinstance(held, ast.Subscript):  # sys.modules["shim"]
                held = held.slice
            if (isinstance(held, ast.Name) and held.id == "shim") or (
                isinstance(held, ast.Constant) and held.value == "shim"
            ):
                found.append(node.attr)
    return [name for name in found if name.startswith("_") and not name.startswith("__")]


def test_no_tools_module_reaches_into_the_front_doors_private_names():
    """The tools use the front door's public API (``shim.registry``, ``shim.status()``, ``__version__``)
    and the rooms; what they share with it lives in a room below both (the exit report's keys in
    ``shim.runtime``), never in a private name of the front door, which imports the tools."""
    tools = sorted((ENGINE / "tools").rglob("*.py"))
    assert ENGINE / "tools" / "workers.py" in tools, "where this test looks"
    assert private_names_of_shim(ENGINE / "__init__.py") == [], "the front door's own names are no reach"
    offenders = {path.name: names for path in tools if (names := private_names_of_shim(path))}
    assert offenders == {}


def test_no_patch_imports_another_patch():
    """A patch is one bug's fix: what two patches share lives in a helper module (``_name.py``),
    never in another patch, so switching one off or deleting it never changes another."""
    patches = {path.stem for path in (ROOT / "patches").glob("*.py") if not path.name.startswith("_")}
    assert {"checkpointing_restore", "load_keeps_requires_grad"} <= patches, "where this test looks"
    offenders = []
    for name in sorted(patches):
        for module in imports(ROOT / "patches" / f"{name}.py"):
            if module.startswith("shim.patches.") and module.removeprefix("shim.patches.") in patches:
                offenders.append(f"{name} imports {module}")
    assert offenders == []


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


def names_in(tree) -> set[str]:
    """Every name ``tree`` reads: variables, attributes (``models.tiny_llama``), imported names."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rpartition(".")[2])
    return found


def test_the_self_checks_wing_holds_only_what_shipped_code_uses():
    """``shim/selfcheck`` ships in the wheel for the patches' bug probes: each function, class and
    constant it defines is used by a patch or the shim (or by one that is); what only the tests and
    the benchmarks build is in tests/tinymodels.py and tests/steps.py, and nothing shipped imports the tests."""
    defined = {}
    for path in sorted((ENGINE / "selfcheck").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update((target.id, node) for target in targets if isinstance(target, ast.Name))
    assert {"model", "layer_class", "StandIn"} <= set(defined), "where this test looks"
    shipped = [
        path for path in [*ENGINE.rglob("*.py"), *(ROOT / "patches").glob("*.py")] if "selfcheck" not in path.parts
    ]
    used = set().union(*(names_in(ast.parse(path.read_text())) for path in shipped))
    reached, frontier = set(), used & set(defined)
    while frontier:  # tiny_llama is used, and uses tiny_llama_config
        name = frontier.pop()
        reached.add(name)
        frontier |= (names_in(defined[name]) & set(defined)) - reached
    assert sorted(set(defined) - reached) == []
    assert [path.name for path in shipped if any(module.split(".")[0] == "tests" for module in imports(path))] == []
