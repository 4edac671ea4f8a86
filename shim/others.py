"""Other patchers on the shim's targets: who they are and where they sit, named when asked.

Another library (unsloth, axolotl, a team's own monkey patch) may have replaced a target before or
after the shim wrapped it, wrapped it again on top, or fix the same bug its own way. This room finds
them (:class:`Other`: bypassed, above, below, same fix) and logs each once per process (a warning
where the fix does not run), when it is asked: a status (``python -m shim``, doctor, the exit
report), and an apply while the ``shim`` logger shows DEBUG
(``SHIM_LOG_LEVEL=DEBUG``). Applying a patch never comes here otherwise: what decides behaviour
there (a layer replaced by a reload, or by someone else) is ``shim.layers``'.

The libraries it counts as upstream's are those the registered patches target (:func:`note_upstream`).

Imported when the first patch applies, never by ``import shim`` itself.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import wrapt

from . import wrapping

if TYPE_CHECKING:
    from .catalogue import Listing
    from .layers import Layer, Layers
    from .patch import Patch


class Looked(Protocol):
    """What this room reads of a patch's entry (``shim.entry.Entry``)."""

    @property
    def name(self) -> str: ...

    layers: Layers | None
    patch: Patch | None


log = logging.getLogger("shim")

BYPASSED, ABOVE, BELOW, SAME_FIX = "bypassed", "above", "below", "same fix"
#: What the patched libraries run on, beside the libraries themselves (:func:`note_upstream`).
PLATFORM = frozenset({"torch", "builtins", "functools"})
#: Where upstream's own functions live: the top-level packages of every registered patch's target
#: and consumer modules, and :data:`PLATFORM`. Anything else in a target's wrapper chain is another
#: patcher's.
_upstream: set[str] = set(PLATFORM)


def note_upstream(registered: Iterable[Listing]) -> None:
    """Count the packages of the ``registered`` patches' target modules as upstream's."""
    _upstream.update(name.partition(".")[0] for declared in registered for name in declared.modules)


class Other(NamedTuple):
    """Another patcher's object on one of the shim's targets, and where it sits."""

    target: str  # "module:path", or "module.attribute" for a name the shim rebound
    relation: str  # BYPASSED (the fix does not run there), ABOVE (it runs first), BELOW (the fix runs first),
    # or SAME_FIX (beside the targets: it fixes the same bug its own way)
    by: str  # "module:qualname" where it was defined
    file: str  # its source file, or ""
    covers: str = ""  # SAME_FIX: for what its fix holds

    def text(self) -> str:
        by = _located(self.by, self.file)
        if self.relation == SAME_FIX:
            return f"{self.target} holds {by}, which fixes the same bug for {self.covers}: both can be on"
        if self.relation == BYPASSED:
            return f"{self.target} was replaced by {by}: the fix does not run there"
        if self.relation == ABOVE:
            return f"{self.target} is wrapped again by {by}: it runs first, then the fix"
        return f"{self.target} held {by} when the shim wrapped it: the fix runs first, then it"


def _definition(obj: object, home: str) -> tuple[str, str] | None:
    """``(module:qualname, file)`` of where ``obj`` was written, or ``None`` for upstream's own: the
    target's package (``home``), the libraries the shim patches, torch (named as :func:`_code_of`
    finds them). The standard library's decorators (``contextlib.contextmanager``) and the shim's
    own parts are no other patcher."""
    if obj is wrapt.MISSING or wrapping.is_dispatch(obj):
        return None
    obj, code, module, qualname, file = _code_of(obj)
    top = module.partition(".")[0]
    if top in sys.stdlib_module_names and top not in _upstream:  # a decorator: whose function it decorates
        inner = getattr(obj, "__wrapped__", None)
        return _definition(inner, home) if inner is not None and inner is not obj else None
    if top == "shim":
        return None
    if top in _upstream or top == home:
        if code is None or not file.startswith("<"):
            return None
        file = f"{file}: its source re-executed by another patcher"  # upstream's functions come from files
    return f"{module}:{qualname}", file


def _code_of(obj: object) -> tuple[object, Any, str, str, str]:
    """``(function, code, module, qualname, file)`` of the code ``obj`` runs: a wrapt wrapper's
    wrapper function, a method's or partial's function; a ``functools.wraps`` copy by its own code
    and globals, not the names it copied. ``code`` is ``None`` (and ``file`` ``""``) for what has
    none: a class, a C function."""
    if isinstance(obj, wrapt.BaseObjectProxy):  # a wrapt wrapper: its wrapper function says whose
        try:
            obj = object.__getattribute__(obj, "_self_wrapper")
        except AttributeError:
            obj = type(obj)
    obj = getattr(obj, "__func__", obj)
    while isinstance(obj, functools.partial):
        obj = obj.func
    code = getattr(obj, "__code__", None)
    if code is not None:
        module = getattr(obj, "__globals__", {}).get("__name__", "?")
        return obj, code, module, getattr(code, "co_qualname", code.co_name), code.co_filename
    kind = obj if isinstance(obj, type) else type(obj)
    module = kind.__module__
    if module == "builtins":  # a C function or slot wrapper: its own module, when it says
        module = getattr(obj, "__module__", None) or "builtins"
    return obj, None, module, kind.__qualname__, ""


def written_by(obj: object) -> str:
    """Where the code ``obj`` runs was written: ``module:qualname (file)``, as status names another
    patcher (for an effect that says who replaced something the shim does not wrap)."""
    _, _, module, qualname, file = _code_of(obj)
    return _located(f"{module}:{qualname}", file)


def _located(by: str, file: str) -> str:
    """``module:qualname (file)``, as the status lines and effects name another patcher's code."""
    return f"{by} ({file})" if file else by


def _name(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def on_layer(layer: Layer, patch: str) -> list[Other]:
    """Other patchers on one of patch ``patch``'s layers: above it, below it, or in its place."""
    spec, home = layer.spec, layer.module_name.partition(".")[0]
    try:
        current = wrapping.object_at(layer.module, layer.path)
    except wrapping.PathResolutionError:
        return []
    found: list[Other] = []
    chain = list(wrapt.wrapper_chain(current))
    if not any(entry is layer.handle for entry in chain) and not wrapping.holds(current, layer.handle):
        where = _definition(current, home)
        if where is not None:  # else upstream's own again (a reload): the engine's stale check says so
            found.append(Other(spec, BYPASSED, *where))
        return found
    for entry in chain:
        if entry is layer.handle or patch in wrapping.patch_names_of(entry):
            break
        if not wrapping.patch_names_of(entry) and (where := _definition(entry, home)) is not None:
            if Other(spec, ABOVE, *where) not in found:
                found.append(Other(spec, ABOVE, *where))
    for entry in wrapt.wrapper_chain(layer.original):
        if not wrapping.patch_names_of(entry) and (where := _definition(entry, home)) is not None:
            found.append(Other(spec, BELOW, *where))
            break  # the outermost one names it; what it wraps is its business
    return found


def same_fixes(patch: Patch) -> list[Other]:
    """The patchers of ``patch.same_fix`` that are on: the owner carries the mark and the attribute
    holds code that is not upstream's. Modules nobody imported are not looked into."""
    found = []
    for same in patch.same_fix:
        module = sys.modules.get(same.module)
        if module is None:
            continue
        try:
            owner = wrapping.object_at(module, same.path.rpartition(".")[0])
            current = wrapping.object_at(module, same.path)
        except wrapping.PathResolutionError:
            continue
        if not getattr(owner, same.mark, False):
            continue
        where = _definition(current, same.module.partition(".")[0])
        if where is not None:
            found.append(Other(same.spec, SAME_FIX, *where, covers=same.covers))
    return found


def blocking(patch: Patch, module_names: list[str]) -> list[Other]:
    """Targets of ``patch`` in ``module_names`` that hold another patcher's object, not upstream's
    (said when the patch cannot apply to them: its shape check refused what it found there)."""
    found = []
    for target in patch.targets:
        module = sys.modules.get(target.module)
        if target.module not in module_names or module is None or target.assign:
            continue
        try:
            current = wrapping.object_at(module, target.path)
        except wrapping.PathResolutionError:
            continue
        for entry in wrapt.wrapper_chain(current):  # under the layers of the shim's other patches
            if not wrapping.patch_names_of(entry):
                where = _definition(entry, target.module.partition(".")[0])
                if where is not None:
                    found.append(Other(target.spec, BYPASSED, *where))
                break
    return found


def on_layers(layers: Layers, consumers: bool = True) -> list[Other]:
    """Other patchers on this patch's layers, and (``consumers``) on the names it rebound (a
    rebound copy replaced since is bypassed: calls through that name skip the fix) and the
    consumer modules' other copies, which takes a walk over ``sys.modules``."""
    found = [other for layer in layers.placed for other in on_layer(layer, layers.name)]
    if not consumers:
        return found
    for module, attribute, handle, _original in layers.rebound:
        current = getattr(module, attribute, None)
        if current is handle:
            continue
        where = _definition(current, getattr(handle, "__module__", "").partition(".")[0])
        if where is not None:
            calls = any(e is handle for e in wrapt.wrapper_chain(current)) or wrapping.holds(current, handle)
            relation = ABOVE if calls else BYPASSED
            found.append(Other(f"{getattr(module, '__name__', module)}.{attribute}", relation, *where))
    found += _copies_around(layers)
    return found


def _copies_around(layers: Layers) -> list[Other]:
    """Consumer modules whose copy of a target wraps upstream's function, not the shim's layer
    (put there before the shim applied, so the rebinding did not recognise it): calls through
    that name skip the fix."""
    found = []
    rebound = {(id(module), attribute) for module, attribute, *_ in layers.rebound}
    for layer in layers.placed if layers.consumers else ():
        for name, value in _copies_of(layer, layers.consumers, rebound):
            other = _bypassing(layer, name, value)
            if other is not None:
                found.append(other)
    return found


def _copies_of(layer: Layer, consumers: Iterable[str], rebound: set[tuple[int, str]]) -> Iterator[tuple[str, Any]]:
    """``(module.attribute, value)`` of each consumer module (matching a pattern of ``consumers``) that
    holds something of ``layer``'s attribute name other than the layer, upstream's object or a name
    the patch rebound (``rebound``: ``(id(module), attribute)``)."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not any(fnmatch.fnmatchcase(module_name, pattern) for pattern in consumers):
            continue
        value = getattr(module, "__dict__", {}).get(layer.attribute)
        if value is None or value is layer.handle or value is layer.original:
            continue
        if (id(module), layer.attribute) not in rebound:
            yield f"{module_name}.{layer.attribute}", value


def _bypassing(layer: Layer, name: str, value: object) -> Other | None:
    """``value``, a consumer's name ``name``, as another patcher whose calls skip ``layer``'s fix; ``None``
    where it is the shim's own layer or no copy of the target."""
    if any(wrapping.patch_names_of(entry) for entry in wrapt.wrapper_chain(value)):
        return None  # the shim's own layers (this patch's, or another's on the same function)
    home = layer.module_name.partition(".")[0]
    if getattr(value, "__module__", None) == layer.module_name and _definition(value, home) is None:
        # upstream's own function, as the target held it before another patcher's
        # replacement, which the shim wrapped: calls through this name skip both
        return Other(name, BYPASSED, _name(value), "upstream's, from before another patcher replaced the target")
    if not (any(e is layer.original for e in wrapt.wrapper_chain(value)) or wrapping.holds(value, layer.original)):
        return None  # another function of that name, not a copy of the target
    where = _definition(value, home)
    if where is None or wrapping.holds(value, layer.handle):
        return None
    return Other(name, BYPASSED, *where)


# -- saying what was found ----------------------------------------------------------------------------

_seen: set[Other] = set()  # other patchers already logged (once per process each)


def of_entry(entry: Looked, consumers: bool = True) -> list[Other]:
    """Other patchers on ``entry``'s targets (``consumers``: also on the names it rebound and the
    consumer modules' copies, a walk over ``sys.modules``) and those known to fix the same bug
    (``Patch.same_fix``) while it is on; each new one logged."""
    layers = entry.layers
    if not layers:
        return []
    found = on_layers(layers, consumers)
    if entry.patch is not None:
        found += same_fixes(entry.patch)
    say(entry.name, found)
    return found


def say(name: str, found: Iterable[Other]) -> None:
    """Log each of ``found`` the first time it is found in this process (a warning where it bypasses
    patch ``name``'s fix)."""
    for other in found:
        if other not in _seen:
            _seen.add(other)
            level = logging.WARNING if other.relation == BYPASSED else logging.INFO
            log.log(level, "%s: %s", name, other.text())
