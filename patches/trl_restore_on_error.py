"""``trl-restore-on-error``: an exception during trl's generation leaves checkpointing on.

Symptom (silent): trl's generation context manager switches checkpointing off (and, under ZeRO-3,
removes DeepSpeed's parameter hooks), yields, and switches it back on with no ``try/finally``. An
exception in the body that the trainer catches leaves checkpointing off, and the hooks removed, for
the rest of training.

Fix: the context manager is wrapped in one that runs trl's own code untouched when the body
succeeds. Only when the body raised does it re-add trl's ZeRO-3 hooks if they are missing and
re-enable checkpointing if it was on at entry, with the ``gradient_checkpointing_kwargs`` the caller
passed (``checkpointing-restore`` brings back the rest). Trainer modules that imported the public
name early are rebound (``consumers``).

Limits: the original exception always propagates; a failing clean-up is logged, never raised in
its place. Only kwargs passed by keyword are forwarded; other trl contexts are not wrapped.

Full story, versions measured and references: docs/bugs.md#trl-restore-on-error
"""

from __future__ import annotations

import logging
import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument
from ._checkpointing_calls import enable, is_checkpointing
from ._checkpointing_state import any_checkpointing

log = logging.getLogger("shim")
NAME = "trl-restore-on-error"


def _zero3_hooks_removed(engine) -> bool:
    """Whether trl's ``remove_hooks`` left this DeepSpeed engine without its forward hooks."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None) or optimizer
    hooks = getattr(offload, "forward_hooks", None)
    return isinstance(hooks, list) and not hooks and hasattr(offload, "_register_deepspeed_module")


# What accelerate's unwrap_model takes off (its walk over every module to look for compiled regions
# costs more than trl's whole disable/enable cycle, so it runs only after an exception).
_CONTAINERS = frozenset({"DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "FullyShardedDataParallel"})


_is_container: dict = {}  # class -> whether it is one of _CONTAINERS (or derives from one)


def _container(cls) -> bool:
    known = _is_container.get(cls)
    if known is None:
        if len(_is_container) > 1024:
            _is_container.clear()
        known = _is_container[cls] = any(c.__name__ in _CONTAINERS for c in cls.__mro__)
    return known


def _unwrapped(model):
    """The model inside distributed containers and ``torch.compile``, like ``accelerator.unwrap_model``."""
    for _ in range(8):
        modules = getattr(model, "__dict__", {}).get("_modules") or {}
        if type(model).__name__ == "OptimizedModule" and "_orig_mod" in modules:
            model = modules["_orig_mod"]
        elif "module" in modules and _container(type(model)):
            model = modules["module"]
        else:
            break
    return model


class _RestoreOnError:
    """trl's context manager, plus the clean-up trl skips when the body raises."""

    def __init__(self, context, model, accelerator, gather, checkpoint_kwargs):
        self._context = context
        self._model = model
        self._accelerator = accelerator
        self._gather = gather
        self._checkpoint_kwargs = checkpoint_kwargs
        self._unwrapped = None
        self._was_checkpointing = False

    def __enter__(self):
        try:
            self._was_checkpointing = any_checkpointing(_unwrapped(self._model))
        except Exception:  # a container this shortcut does not know: ask accelerate
            try:
                self._was_checkpointing = is_checkpointing(self._accelerator.unwrap_model(self._model))
            except Exception:  # never break trl's own context over a check of ours
                self._was_checkpointing = False
        return self._context.__enter__()

    def __exit__(self, exc_type, exc, traceback):
        try:
            return self._context.__exit__(exc_type, exc, traceback)
        finally:
            if exc_type is not None:
                self._clean_up_after(exc_type)

    def _clean_up_after(self, exc_type) -> None:
        done = []
        try:
            self._unwrapped = self._accelerator.unwrap_model(self._model)
            if self._gather and _zero3_hooks_removed(self._model):
                sys.modules["trl.models.utils"].add_hooks(self._model)
                done.append("re-added DeepSpeed ZeRO-3 hooks")
            if self._was_checkpointing and not is_checkpointing(self._unwrapped):
                enable(self._unwrapped, self._checkpoint_kwargs)
                done.append("re-enabled gradient checkpointing")
        except Exception:  # the body's exception is the one the user must see
            log.exception("%s: could not restore checkpointing after %s", NAME, exc_type.__name__)
        if done:
            record_effect(
                NAME,
                "%s raised inside trl's unwrap_model_for_generation on %s, which trl leaves without "
                "checkpointing; the shim %s",
                exc_type.__name__, type(self._unwrapped).__name__, " and ".join(done),
            )  # fmt: skip


def _unwrap_model_for_generation(wrapped, instance, args, kwargs):
    context = wrapped(*args, **kwargs)
    return _RestoreOnError(
        context,
        model=argument(args, kwargs, 0, "model"),
        accelerator=argument(args, kwargs, 1, "accelerator"),
        gather=argument(args, kwargs, 2, "gather_deepspeed3_params", True),
        checkpoint_kwargs=kwargs.get("gradient_checkpointing_kwargs"),
    )


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


class _Failed(Exception):
    """What the probe's generation raises."""


def _bug_probe() -> Evidence:
    """trl's ``unwrap_model_for_generation`` on a bare model that checkpoints, through a stand-in
    accelerator (one process, no DeepSpeed), its body raising: the bug is there when checkpointing is
    off afterwards."""
    model = bare.model()
    enable(model, {"use_reentrant": False})
    accelerator = bare.StandIn(unwrap_model=lambda model, **kwargs: model, state=bare.StandIn(deepspeed_plugin=None))
    try:
        with sys.modules["trl.models.utils"].unwrap_model_for_generation(model, accelerator):
            raise _Failed
    except _Failed:
        pass
    if not is_checkpointing(model):
        return Evidence(True, "an exception inside unwrap_model_for_generation leaves checkpointing off")
    return Evidence(False, "an exception inside unwrap_model_for_generation leaves checkpointing on")


PATCH = Patch(
    name=NAME,
    summary="An exception inside trl's unwrap_model_for_generation no longer leaves checkpointing off.",
    distribution="trl",
    requires=">=0.22",
    targets=(
        Target("trl.models.utils:_unwrap_model_for_generation", _unwrap_model_for_generation, requires="trl>=0.29"),
        Target("trl.models.utils:unwrap_model_for_generation", _unwrap_model_for_generation, requires="trl<0.29"),
    ),
    references=("docs/bugs.md#trl-restore-on-error", "huggingface/trl#6659"),
    consumers=("trl.*",),
    bug_probe=BugProbe(_bug_probe, needs=("trl.distributed",)),
)
