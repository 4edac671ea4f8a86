"""The checkpointing path, public: how a patch, built-in or a pack's, adds a step on the way a
``GradientCheckpointingLayer`` gets and calls its checkpoint function.

A step is declared in the patch's own module and given to its patch with :func:`targets`. It has
no name: it is its patch's (the engine hands its part the patch's name and switch as the patch
applies), ordered with every other step by its patch's place in the catalogue-wide order
(``Patch.after``, ``Patch.place``: ``shim.order``); nothing else is edited for a new step::

    from shim import Patch, record_effect
    from shim.checkpointing import Step, check, eager, hand_over, in_effect, is_reentrant, targets

    STEP = Step(applies=is_reentrant, act=_act)
    PATCH = Patch(name=NAME, ..., targets=targets(STEP, check=check), in_effect=in_effect(STEP, "..."))

- :mod:`shim.checkpointing.path`: the path itself: :class:`Step`, :func:`targets` (the two targets
  every step's patch takes, :data:`SLOT` and :data:`SETSTATE`), the shared shape :func:`check` of
  the call (``probe``, its old name), :func:`in_effect`, and :data:`ATTRIBUTE`, the layer's
  attribute the path watches.
- :mod:`shim.checkpointing.function`: what a layer holds where a step applies
  (:class:`LayerCheckpoint`) and what a step uses to read and hand over a call: :func:`hand_over`,
  :class:`LayerMethod`, :func:`layer_of`, :func:`is_reentrant`, :func:`any_grad`,
  :func:`wants_grad`, :func:`bind_torch`, and :func:`eager` for the step's per-call code.

``import shim`` itself does not import this package: a patch module with a step does, a built-in's
when its target module is imported, a pack's whenever the shim imports that module. It imports
neither torch nor transformers itself.
"""

from __future__ import annotations

from .function import (
    LayerCheckpoint,
    LayerMethod,
    any_grad,
    bind_torch,
    eager,
    hand_over,
    is_reentrant,
    layer_of,
    wants_grad,
)
from .path import ATTRIBUTE, SETSTATE, SLOT, Step, check, in_effect, probe, targets

__all__ = [
    "ATTRIBUTE",
    "SETSTATE",
    "SLOT",
    "LayerCheckpoint",
    "LayerMethod",
    "Step",
    "any_grad",
    "bind_torch",
    "check",
    "eager",
    "hand_over",
    "in_effect",
    "is_reentrant",
    "layer_of",
    "probe",
    "targets",
    "wants_grad",
]
