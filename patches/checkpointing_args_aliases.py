"""``checkpointing-args-aliases``: TrainingArguments' old and new checkpointing names stay one.

Symptom (silent): ``gradient_checkpointing[_kwargs]`` are deprecated aliases of
``activation_checkpointing[_kwargs]``, copied into them once in ``__post_init__``; the Trainer reads
only the new names, trl reads and writes the old ones. ``args.gradient_checkpointing = True`` after
parsing trains with no layer checkpointed; trl's forced ``use_reentrant=True`` (PEFT under ZeRO-3),
written to the old name when the kwargs were unset, never reaches the model.

Fix: ``TrainingArguments.__setattr__`` is wrapped: after ``__post_init__``, while both names of a
pair hold the same value, a value assigned to one is stored under the other as well.
``__post_init__`` is wrapped: a ``dataclasses.replace()`` copy that changed only the old name
keeps that change (upstream keeps the copied new name); other instances given two different values
for a pair get a warning.

Limits: a rebuild from ``to_dict()`` passes both names and which one was changed cannot be told:
upstream's rule stands (the new name wins) and the shim warns. A pair made different before the
shim was on stays as it is.

Full story, versions measured and references: docs/bugs.md#checkpointing-args-aliases
"""

from __future__ import annotations

import logging
import sys
import warnings

from shim import BugProbe, Evidence, Patch, ShimWarning, Target, record_effect

log = logging.getLogger("shim")

NAME = "checkpointing-args-aliases"
PAIRS = (
    ("gradient_checkpointing", "activation_checkpointing"),
    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
)
_PARTNER = {old: new for old, new in PAIRS} | {new: old for old, new in PAIRS}
_MISSING = object()
_resolving: set[int] = set()  # ids of instances inside TrainingArguments.__post_init__


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value that cannot be compared is not the same value
        return False


def _setattr(wrapped, instance, args, kwargs):
    name = args[0] if args else None
    partner = _PARTNER.get(name) if type(name) is str else None
    state = getattr(instance, "__dict__", None) if partner is not None else None
    if state is None or id(instance) in _resolving:  # __post_init__ makes the pair one itself
        return wrapped(*args, **kwargs)
    before, other = state.get(name, _MISSING), state.get(partner, _MISSING)
    result = wrapped(*args, **kwargs)
    if before is _MISSING or other is _MISSING or not _same(before, other):
        return result  # during construction, or a pair that was already apart
    value = state.get(name, _MISSING)
    if value is not _MISSING and not _same(value, other):
        state[partner] = value  # the instance's own slot: no second round through __setattr__
        record_effect(
            NAME,
            "set %s.%s as well when %s was assigned after construction (%r): the Trainer reads the "
            "activation_* name, trl the gradient_* one",
            type(instance).__name__, partner, name, value,
        )  # fmt: skip
    return result


def _post_init(wrapped, instance, args, kwargs):
    state = getattr(instance, "__dict__", {})
    given = {name: state.get(name) for pair in PAIRS for name in pair}
    apart = [
        (old, new)
        for old, new in PAIRS
        if not (given[old] is None or given[new] is None or _same(given[old], given[new]))
    ]
    source = _replaced_from(instance) if apart else None
    kept = []
    for old, new in apart:
        if source is not None:
            copied = vars(source)
            if _same(given[new], copied.get(new, _MISSING)) and not _same(given[old], copied.get(old, _MISSING)):
                state[new] = given[old]  # the name the copy changed; upstream would keep the copied new one
                kept.append((old, given[old], new, given[new]))
        elif not _same(given[old], getattr(fields_of(instance).get(old), "default", None)):  # trl defaults it True
            message = (
                f"shim ({NAME}): {type(instance).__name__} was given {old}={given[old]!r} and "
                f"{new}={given[new]!r}; transformers uses {new}={given[new]!r}. If {old} was changed in a "
                f"copy rebuilt from to_dict(), set {new} instead."
            )
            log.warning(message)
            warnings.warn(message, ShimWarning, stacklevel=2)
    _resolving.add(id(instance))
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _resolving.discard(id(instance))
    for old, value, new, copied_value in kept:
        record_effect(
            NAME,
            "kept %s=%r that dataclasses.replace() was given (upstream keeps the copied %s=%r)",
            old, value, new, copied_value,
        )  # fmt: skip
    return result


def fields_of(instance) -> dict:
    return getattr(type(instance), "__dataclass_fields__", {})


def _replaced_from(instance):
    """The instance ``dataclasses.replace()`` is copying, when it is what builds ``instance``."""
    import dataclasses

    codes = {dataclasses.replace.__code__} | {getattr(getattr(dataclasses, "_replace", None), "__code__", None)}
    frame = sys._getframe(1)
    for _ in range(8):  # replace -> the class's __init__ -> (subclasses' __post_init__) -> here
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code in codes:
            source = frame.f_locals.get("obj", frame.f_locals.get("self"))
            return source if isinstance(source, type(instance)) or isinstance(instance, type(source)) else None
    return None


def _check(original) -> str | None:
    from transformers import TrainingArguments

    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    missing = [name for pair in PAIRS for name in pair if name not in fields]
    return f"TrainingArguments has no field(s) {', '.join(missing)}" if missing else None


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """Arguments (made without ``__init__``: no output folder, no device set up) holding both names of
    each pair as one, then each of the four names assigned after construction: the bug is there when
    its partner does not follow (a fix for the flag alone leaves the patch the kwargs)."""
    arguments_class = sys.modules["transformers.training_args"].TrainingArguments
    if _check(arguments_class) is not None:
        return Evidence(False, "TrainingArguments has one name per checkpointing setting: no alias to lose")
    apart = []
    for old, new in PAIRS:
        value = True if old == "gradient_checkpointing" else {"use_reentrant": True}
        for name in (old, new):
            arguments = arguments_class.__new__(arguments_class)
            for pair in PAIRS:
                object.__setattr__(arguments, pair[0], None)
                object.__setattr__(arguments, pair[1], None)
            setattr(arguments, name, value)
            if getattr(arguments, _PARTNER[name]) != value:
                apart.append(name)
    if apart:
        return Evidence(True, f"{', '.join(apart)} assigned after construction leave(s) the other name unset")
    return Evidence(False, "each checkpointing name assigned after construction sets its partner too")


PATCH = Patch(
    name=NAME,
    summary="Checkpointing set on TrainingArguments' old names after construction reaches the Trainer.",
    distribution="transformers",
    requires=">=5.23",
    targets=(
        Target("transformers.training_args:TrainingArguments.__setattr__", _setattr, check=_check),
        Target("transformers.training_args:TrainingArguments.__post_init__", _post_init, check=_check),
    ),
    references=("docs/bugs.md#checkpointing-args-aliases",),
    bug_probe=BugProbe(_bug_probe),
)
