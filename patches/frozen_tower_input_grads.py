"""``frozen-tower-input-grads``: a frozen sub-model's input embeddings are not made to require grad.

Symptom (time and memory, no wrong number): enabling checkpointing hooks the input embeddings of
every ``PreTrainedModel`` inside the model, so a frozen vision tower's output requires grad and
backward runs through all its frozen blocks for no gradient (3.4× the step time and 3× the peak
memory in ``benchmarks/frozen_tower_input_grads.py``).

Fix: ``PreTrainedModel.enable_input_require_grads`` is wrapped, outside ``input-grad-hook-dedupe``. Each hook upstream put on a *sub-model's* embeddings is replaced, under
the same hook id, by one that calls upstream's hook only while that sub-model has a trainable
parameter, checked per forward (a tower unfrozen later gets its hook back at once). The model's own
embeddings keep upstream's hook; switched off, a replaced hook runs upstream's again.

Limits: the check walks the sub-model's parameters on each of its forwards (tens of µs for the
benchmark's tower). A sub-model frozen by other means (``torch.no_grad``) and hooks put on the
embeddings by other code are left alone.

Full story, versions measured and references: docs/bugs.md#frozen-tower-input-grads
"""

from __future__ import annotations

import copy
import weakref

from shim import BugProbe, Evidence, Patch, Target, record_effect, switch_of
from shim.selfcheck import bare

from ._modules import first_trainable

NAME = "frozen-tower-input-grads"
# model -> (a weak reference to) its own input embeddings, as last found: an enable of a model whose
# hooks all sit there (a text-only model) is answered without asking the model again. Weak both ways.
_own_embeddings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _WhileTrainable:
    """A forward hook that runs upstream's input-require-grads hook only while ``owner`` (the
    sub-model whose embeddings it sits on) has a trainable parameter. The owner is held weakly:
    the hook lives inside the owner and must not keep it alive. It follows the patch's switch, so
    ``shim.disable()``, ``shim.disabled()`` and ``shim.deactivate()`` give upstream's hook back at once."""

    __slots__ = ("hook", "owner", "names", "switch", "__weakref__")

    def __init__(self, hook, owner, names: tuple[str, str], switch) -> None:
        self.hook = hook
        self.owner = weakref.ref(owner)
        self.names = names  # (sub-model class, model class), for the effects ledger
        self.switch = switch

    def __call__(self, module, inputs, output):
        owner = self.owner()
        if not self.switch or owner is None or first_trainable(owner) is not None:
            return self.hook(module, inputs, output)
        record_effect(
            NAME,
            "kept the frozen %s (in %s) out of backward: upstream makes its input embeddings' output require grad",
            *self.names,
        )  # fmt: skip
        return None

    def __deepcopy__(self, memo: dict):
        # A deep copy of the model copies this hook inside the owner, after the owner itself: the
        # copy's hook watches the copy's owner.
        owner = self.owner()
        copied = memo.get(id(owner), owner) if owner is not None else None
        if copied is None:
            return self
        return _WhileTrainable(copy.deepcopy(self.hook, memo), copied, self.names, self.switch)


def _input_embeddings(model):
    """``model.get_input_embeddings()``, or ``None`` where it has none (as upstream tolerates)."""
    try:
        return model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None


def _pretrained_base(model):
    """The ``PreTrainedModel`` class ``model``'s class derives from, which its sub-models' classes
    derive from too: read from the model, not imported, since a reload of
    ``transformers.modeling_utils`` makes a new one and the models built before keep the old."""
    for cls in type(model).__mro__:
        if cls.__name__ == "PreTrainedModel" and cls.__module__ == "transformers.modeling_utils":
            return cls
    return None


def _sub_models_by_hooks(model) -> dict:
    """``{id(embeddings._forward_hooks): sub-model}`` for each sub-model of ``model`` whose input
    embeddings differ from the model's own; the first sub-model found owns shared embeddings, as in
    upstream's walk."""
    own = _input_embeddings(model)
    owners: dict = {}
    base = _pretrained_base(model)
    for module in model.modules() if base is not None else ():
        if module is model or not isinstance(module, base):
            continue
        embeddings = _input_embeddings(module)
        if embeddings is None or embeddings is own or not hasattr(embeddings, "_forward_hooks"):
            continue
        owners.setdefault(id(embeddings._forward_hooks), module)
    return owners


def _enable_input_require_grads(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    handles = instance.__dict__.get("_require_grads_hooks") if instance is not None else None
    if not handles:
        return result
    known = _own_embeddings.get(instance)
    own = known() if known is not None else None
    own_hooks = getattr(own, "_forward_hooks", None)
    hooked = []
    elsewhere = own is None  # a hook not on the model's own embeddings as last found
    for handle in handles:  # a loop, not comprehensions: it runs at every enable (trl's generation cycle)
        hooks = handle.hooks_dict_ref()
        hooked.append((handle, hooks))
        elsewhere = elsewhere or hooks is not own_hooks
    if not elsewhere:  # a text-only model: nothing to walk
        return result
    own = _input_embeddings(instance)
    if own is not None:
        try:
            _own_embeddings[instance] = weakref.ref(own)
        except TypeError:  # a model or module without weak references: asked again next time
            pass
    own_hooks = getattr(own, "_forward_hooks", None)
    if all(hooks is own_hooks for _handle, hooks in hooked):
        return result
    owners = _sub_models_by_hooks(instance)
    switch = switch_of(NAME)
    for handle, hooks in hooked:
        owner = owners.get(id(hooks)) if hooks is not None and hooks is not own_hooks else None
        hook = hooks.get(handle.id) if owner is not None else None
        if hook is not None and not isinstance(hook, _WhileTrainable):
            names = (type(owner).__name__, type(instance).__name__)
            hooks[handle.id] = _WhileTrainable(hook, owner, names, switch)
    return result


def _in_effect(model) -> list[str]:
    """The sub-models of ``model`` whose input embeddings' hook follows whether they can train."""
    names = None
    lines = []
    for handle in model.__dict__.get("_require_grads_hooks") or ():
        hooks = handle.hooks_dict_ref()
        hook = hooks.get(handle.id) if hooks is not None else None
        owner = hook.owner() if isinstance(hook, _WhileTrainable) else None
        if owner is None:
            continue
        if names is None:
            names = {id(module): name for name, module in model.named_modules()}
        now = (
            "trainable now, so in backward"
            if first_trainable(owner) is not None
            else "frozen now: kept out of backward"
        )
        lines.append(
            f"{names.get(id(owner), '?')} ({type(owner).__name__}) makes its inputs require grad only while it "
            f"has a trainable parameter: {now}"
        )
    return lines


def _check(original) -> str | None:
    """Upstream must keep its hook handles in ``_require_grads_hooks`` and register forward hooks."""
    names = getattr(getattr(original, "__code__", None), "co_names", ())
    if "_require_grads_hooks" not in names or "register_forward_hook" not in names:
        return "enable_input_require_grads no longer registers forward hooks kept in _require_grads_hooks"
    return None


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """A bare model holding a frozen bare sub-model (a tower), input grads enabled on the model: the
    bug is there when the tower's input embeddings' output then requires grad."""
    torch = bare.torch_module()
    model = bare.model_without_layers()
    model.tower = bare.model_without_layers().requires_grad_(False)
    model.enable_input_require_grads()
    if model.tower.embed(torch.zeros(1, dtype=torch.long)).requires_grad:
        return Evidence(
            True, "enable_input_require_grads makes a frozen sub-model's input embeddings' output require grad"
        )
    return Evidence(False, "enable_input_require_grads leaves a frozen sub-model's input embeddings' output as it is")


PATCH = Patch(
    name=NAME,
    summary="A frozen sub-model (a VLM's vision tower) keeps its input embeddings' output free of requires_grad.",
    distribution="transformers",
    requires=">=5.0",
    targets=(
        Target(
            "transformers.modeling_utils:PreTrainedModel.enable_input_require_grads",
            _enable_input_require_grads,
            check=_check,
        ),
    ),
    references=(
        "docs/bugs.md#frozen-tower-input-grads",
        "huggingface/transformers#41993",
        "modelscope/ms-swift#10214",
    ),
    bug_probe=BugProbe(_bug_probe),
    in_effect=_in_effect,
    after=("input-grad-hook-dedupe",),
)
