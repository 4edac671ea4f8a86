"""Builds between releases, for the tests' fresh interpreters: libraries that say a dev version, and
upstream functions replaced by copies with a fix edited in, as a git build of a release to come
would carry it. Installed before ``import shim``, so that the shim meets the module as the import
system hands it over: the fix is in the module's body, before any hook of the shim's runs::

    from tests import devbuild
    devbuild.install(devbuild.DEV_VERSIONS, fixes=["input-grad-hook-dedupe"])
    import shim

The fixes are written here in the tests' words, each the smallest change that removes the bug the
way upstream would (upstream has none of them yet; peft's and DeepSpeed's real fixes are measured on
their releases). Beside them, partial fixes (:data:`PARTIAL`): what a build could carry that fixes
some of the cases a patch fixes and not the others (transformers lifting ``hidden_states=`` alone
into the reentrant checkpoint's inputs), so that a probe is held to every case. Nothing here is shipped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import sys
import types
import weakref

#: A release to come of each library, as its git build says it.
DEV_VERSIONS = {"transformers": "5.26.0.dev0", "trl": "1.17.0.dev0", "peft": "0.22.0.dev0", "accelerate": "1.17.0.dev0"}


def _versioned(version: str, base: type = types.ModuleType) -> type:
    """A module class whose ``__version__`` reads ``version``, whatever the module's code assigns."""
    return type("Versioned", (base,), {"__version__": property(lambda self: version)})


class _Loader:
    def __init__(self, loader, name: str, version: str | None, fix) -> None:
        self.loader, self.name, self.version, self.fix = loader, name, version, fix

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if self.version is not None:
            module.__class__ = _versioned(self.version)
        self.loader.exec_module(module)
        replaced = sys.modules.get(self.name)
        if self.version is not None and replaced is not module and replaced is not None:
            # A lazy module in its place (transformers, trl): its class says the version. transformers
            # makes its lazy module again whenever a module of it imports the package "directly"
            # (processing_utils does): those are told the version as they are made.
            replaced.__class__ = _versioned(self.version, type(replaced))
            _versions_of_lazy_modules(type(replaced).__mro__[1], self.name, self.version)
        if self.fix is not None:
            self.fix(sys.modules.get(self.name, module))

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _versions_of_lazy_modules(lazy: type, name: str, version: str) -> None:
    original = lazy.__init__

    def __init__(self, module_name, *args, **kwargs):
        original(self, module_name, *args, **kwargs)
        if module_name == name:
            self.__class__ = _versioned(version, lazy)

    lazy.__init__ = __init__


class _Finder:
    def __init__(self, versions: dict, fixes: dict) -> None:
        self.versions, self.fixes = versions, fixes

    def find_spec(self, name, path=None, target=None):
        if name not in self.versions and name not in self.fixes:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, name, self.versions.get(name), self.fixes.get(name))
        return spec


def install(versions: dict, fixes: list[str] = ()) -> None:
    """Make the libraries of ``versions`` say those versions, and edit the fixes named in ``fixes`` (a
    patch's name: :data:`FIXES`; a partial fix's: :data:`PARTIAL_FIXES`) into upstream's code, at their
    modules' import (call it before ``import shim``)."""
    by_module: dict = {}
    for name in fixes:
        for module, fix in {**FIXES, **PARTIAL_FIXES}[name]:
            by_module.setdefault(module, []).append(fix)
    chained = {module: (lambda m, fs=tuple(fs): [f(m) for f in fs]) for module, fs in by_module.items()}
    sys.meta_path.insert(0, _Finder(dict(versions), chained))


# -- the fixes, edited in --------------------------------------------------------------------------


_INPUT_GRAD_FIXES: set = set()  # which of the two fixes the copy of enable_input_require_grads has


def _input_grads(fix: str):
    """``enable_input_require_grads`` as 5.25 has it, with ``fix`` edited in: ``dedupe`` removes the hooks
    the model still holds before adding new ones; ``frozen`` hooks no sub-model without a trainable
    parameter. A partial fix: ``dedupe:first`` removes only the hook kept for backward compatibility
    (``_require_grads_hook``, the model's own embeddings'), so a sub-model's hooks still pile up."""

    def install(modeling_utils) -> None:
        _INPUT_GRAD_FIXES.add(fix)
        cls = modeling_utils.PreTrainedModel
        if getattr(cls.enable_input_require_grads, "_devbuild", False):
            return

        def enable_input_require_grads(self):
            if "dedupe" in _INPUT_GRAD_FIXES:
                for handle in getattr(self, "_require_grads_hooks", None) or ():
                    handle.remove()
            elif "dedupe:first" in _INPUT_GRAD_FIXES and getattr(self, "_require_grads_hook", None) is not None:
                self._require_grads_hook.remove()

            def make_inputs_require_grads(module, input, output):
                output.requires_grad_(True)

            hooks, seen = [], set()
            for module in self.modules():
                if not (isinstance(module, cls) and hasattr(module, "get_input_embeddings")):
                    continue
                if "frozen" in _INPUT_GRAD_FIXES and module is not self:
                    if not any(parameter.requires_grad for parameter in module.parameters()):
                        continue
                try:
                    embeddings = module.get_input_embeddings()
                except NotImplementedError:
                    continue
                if embeddings is None or id(embeddings) in seen:
                    continue
                seen.add(id(embeddings))
                hooks.append(embeddings.register_forward_hook(make_inputs_require_grads))
            self._require_grads_hooks = hooks
            if hooks:
                self._require_grads_hook = hooks[0]

        enable_input_require_grads._devbuild = True
        cls.enable_input_require_grads = enable_input_require_grads

    return install


def _keeping_frozen(original, name_of):
    """A loader that puts a frozen parameter's flag back on the one that replaces it."""

    @functools.wraps(original)
    def load(*args, **kwargs):
        model, name = args[0] if args else kwargs["model"], name_of(args, kwargs)
        path, _, attribute = name.rpartition(".")
        module = model.get_submodule(path) if path else model
        before = module._parameters.get(attribute)
        result = original(*args, **kwargs)
        after = module._parameters.get(attribute)
        if before is not None and after is not None and not before.requires_grad:
            after.requires_grad_(False)
        return result

    return load


def _loading_keeps_frozen(module) -> None:
    if hasattr(module, "set_param_for_module"):
        module.set_param_for_module = _keeping_frozen(
            module.set_param_for_module, lambda args, kwargs: args[1] if len(args) > 1 else kwargs["target_name"]
        )
    if hasattr(module, "_load_parameter_into_model"):
        module._load_parameter_into_model = _keeping_frozen(
            module._load_parameter_into_model, lambda args, kwargs: args[1] if len(args) > 1 else kwargs["param_name"]
        )


def _trl_re_enables(fits_every_signature: bool):
    """trl's ``disable_gradient_checkpointing`` re-enabling by keyword, and where ``fits_every_signature``
    with no argument to an enable that takes none (a partial fix: by keyword alone, which an enable
    without parameters refuses)."""

    def install(utils) -> None:
        import inspect

        @contextlib.contextmanager
        def disable_gradient_checkpointing(model, gradient_checkpointing_kwargs=None):
            was_enabled = model.is_gradient_checkpointing
            if was_enabled:
                model.gradient_checkpointing_disable()
            try:
                yield
            finally:
                if was_enabled:
                    enable = model.gradient_checkpointing_enable
                    if fits_every_signature and not inspect.signature(enable).parameters:
                        enable()
                    else:
                        enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

        utils.disable_gradient_checkpointing = disable_gradient_checkpointing

    return install


def _trl_restores_on_error(utils) -> None:
    name = (
        "_unwrap_model_for_generation"
        if hasattr(utils, "_unwrap_model_for_generation")
        else "unwrap_model_for_generation"
    )
    original = getattr(utils, name)

    @contextlib.contextmanager
    def unwrap(model, accelerator, *args, **kwargs):
        unwrapped = accelerator.unwrap_model(model)
        was_enabled = unwrapped.is_gradient_checkpointing
        with original(model, accelerator, *args, **kwargs) as inside:
            try:
                yield inside
            except BaseException:
                if was_enabled and not unwrapped.is_gradient_checkpointing:
                    unwrapped.gradient_checkpointing_enable(kwargs.get("gradient_checkpointing_kwargs"))
                raise

    setattr(utils, name, unwrap)


def _fsdp2_keeps_rng_state(with_offload: bool):
    """``fsdp2_apply_ac`` as accelerate writes it, its checkpoint wrappers told to preserve the RNG state;
    where not ``with_offload`` (a partial fix) only those without activation offload. Edited into its
    source and run in its module, as a git build has it."""

    def install(fsdp_utils) -> None:
        import inspect
        import textwrap

        source = textwrap.dedent(inspect.getsource(fsdp_utils.fsdp2_apply_ac))
        stock = "checkpoint_wrapper(layer, preserve_rng_state=False)"
        kept = "True" if with_offload else "not accelerator.state.fsdp_plugin.activation_checkpointing_offload"
        if stock not in source:
            raise RuntimeError(f"accelerate's fsdp2_apply_ac no longer calls {stock}: edit the fix anew")
        edited = source.replace(stock, f"checkpoint_wrapper(layer, preserve_rng_state={kept})")
        exec(compile(edited, fsdp_utils.__file__, "exec"), vars(fsdp_utils))

    return install


def _layer_states(model) -> list:
    return [
        (module, module.gradient_checkpointing, module.__dict__.get("_gradient_checkpointing_func"))
        for module in model.modules()
        if hasattr(module, "gradient_checkpointing")
    ]


def _put_back(states) -> None:
    for module, flag, function in states:
        module.gradient_checkpointing = flag
        if function is not None:
            module._gradient_checkpointing_func = function


def _kbit_keeps_checkpointing(pattern: bool):
    """``prepare_model_for_kbit_training`` that keeps the checkpointing a model has; where not
    ``pattern`` (a partial fix) it re-enables every layer with the kwargs the first one had."""

    def install(other) -> None:
        original = other.prepare_model_for_kbit_training

        @functools.wraps(original)
        def prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=None, **kw
        ):
            states = _layer_states(model)
            checkpointing = [function for _, flag, function in states if flag]
            if gradient_checkpointing_kwargs is None and checkpointing and not pattern:
                gradient_checkpointing_kwargs = dict(getattr(checkpointing[0], "keywords", {}))
            result = original(model, use_gradient_checkpointing, gradient_checkpointing_kwargs, **kw)
            if pattern and gradient_checkpointing_kwargs is None and checkpointing:
                _put_back(states)
            return result

        other.prepare_model_for_kbit_training = prepare_model_for_kbit_training

    return install


def _kwargs_become_parameters(passed_on: bool):
    """``_activation_checkpointing_enable`` that takes ``every_n_layers``, ``offload`` and ``selective``
    out of the kwargs and passes the first two as its parameters; where not ``passed_on`` (a partial
    fix) it only drops them."""

    def install(modeling_utils) -> None:
        cls = modeling_utils.PreTrainedModel
        original = cls._activation_checkpointing_enable

        def _activation_checkpointing_enable(
            self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False
        ):
            kwargs = dict(activation_checkpointing_kwargs or {})
            taken = {name: kwargs.pop(name) for name in ("every_n_layers", "offload") if name in kwargs}
            kwargs.pop("selective", None)
            if passed_on:
                every_n_layers = taken.get("every_n_layers", every_n_layers)
                offload = taken.get("offload", offload)
            return original(self, kwargs or None, every_n_layers, offload)

        cls._activation_checkpointing_enable = _activation_checkpointing_enable

    return install


def _restores_checkpointing(modeling_utils) -> None:
    """The last disable's layer states come back at an enable given no configuration."""
    cls = modeling_utils.PreTrainedModel
    set_checkpointing, enable = cls._set_gradient_checkpointing, cls._activation_checkpointing_enable
    captured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _set_gradient_checkpointing(self, enable=True, *args, **kwargs):
        if not enable:
            captured[self] = _layer_states(self)
        return set_checkpointing(self, enable, *args, **kwargs)

    def _activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        result = enable(self, activation_checkpointing_kwargs, every_n_layers, offload)
        states = captured.pop(self, None)
        if states and not activation_checkpointing_kwargs and every_n_layers == 1 and not offload:
            _put_back(states)
        return result

    cls._set_gradient_checkpointing = _set_gradient_checkpointing
    cls._activation_checkpointing_enable = _activation_checkpointing_enable


def _aliases_stay_one(kwargs_too: bool):
    """``TrainingArguments.__setattr__`` that sets a name's partner too; where not ``kwargs_too`` (a
    partial fix) for the checkpointing flag alone."""

    def install(training_args) -> None:
        cls = training_args.TrainingArguments
        pairs = {"gradient_checkpointing": "activation_checkpointing"}
        if kwargs_too:
            pairs["gradient_checkpointing_kwargs"] = "activation_checkpointing_kwargs"
        pairs |= {new: old for old, new in pairs.items()}
        original = cls.__setattr__

        def __setattr__(self, name, value):
            original(self, name, value)
            partner = pairs.get(name)
            if partner is not None and partner in self.__dict__ and name in self.__dict__:
                self.__dict__[partner] = value

        cls.__setattr__ = __setattr__

    return install


def _selective_reaches_the_inner_model(selective) -> None:
    original = selective.enable_selective_activation_checkpointing

    @functools.wraps(original)
    def enable_selective_activation_checkpointing(model):
        original(model)
        inner = getattr(getattr(model, "activation_checkpointing_enable", None), "__self__", None)
        if inner is not None and inner is not model and "gradient_checkpointing_enable" not in vars(inner):
            original(inner)

    selective.enable_selective_activation_checkpointing = enable_selective_activation_checkpointing


def _ddp_sees_checkpointing(inside_the_model: bool):
    """The DDP decision gives ``find_unused_parameters=False`` where the arguments ask for checkpointing
    and, where ``inside_the_model``, where any module of the model, wrapped or not, checkpoints
    (upstream asks only a ``PreTrainedModel``); a partial fix reads the arguments alone."""

    def install(trainer) -> None:
        cls = trainer.Trainer
        original = cls._build_accelerator_args

        def _build_accelerator_args(self, **kwargs):
            built = original(self, **kwargs)
            model = getattr(self, "model", None)
            checkpointing = bool(getattr(self.args, "activation_checkpointing", None)) or (
                inside_the_model
                and any(
                    getattr(module, "gradient_checkpointing", False) for module in getattr(model, "modules", tuple)()
                )
            )
            if self.args.ddp_find_unused_parameters is None and checkpointing:
                for handler in built.get("kwargs_handlers") or ():
                    if isinstance(handler, trainer.DistributedDataParallelKwargs):
                        handler.find_unused_parameters = False
            return built

        cls._build_accelerator_args = _build_accelerator_args

    return install


_LAYER_FIXES: set = set()  # which fixes the copy of GradientCheckpointingLayer's forward wrapper has
_WRAPPERS: set = set()  # the copy's forward wrappers, one per layer class


def _keyword_inputs(kwargs: dict, torch) -> list:
    """The keywords whose tensors the copy passes as checkpoint inputs: every one holding a tensor that
    requires grad, also nested (``keyword-grads``); or, as a partial fix would, top-level tensors only
    (``keyword-grads:top-level``) or ``hidden_states`` alone (``keyword-grads:hidden-states``)."""

    def requires_grad(value) -> bool:
        leaves = sys.modules["torch.utils._pytree"].tree_leaves(value)
        return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves)

    if "keyword-grads" in _LAYER_FIXES:
        return [name for name, value in kwargs.items() if requires_grad(value)]
    top = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor) and value.requires_grad]
    if "keyword-grads:top-level" in _LAYER_FIXES:
        return top
    return [name for name in top if name == "hidden_states"] if "keyword-grads:hidden-states" in _LAYER_FIXES else []


def _layers(fix: str):
    """``GradientCheckpointingLayer.__init_subclass__``'s forward wrapper as 5.25 has it (the cache
    arguments left out), with ``fix`` edited in: ``finds-layer`` hands the checkpoint a partial of the
    bound forward (``func.func.__self__`` is the layer); ``keyword-grads`` passes the keyword arguments
    that hold a tensor requiring grad as checkpoint inputs (their leaves, rebuilt inside), the others
    staying the partial's keywords; ``frozen-inputs`` adds a zero-size input that requires grad where
    none does and the layer has a trainable parameter; ``replaced-forward`` checkpoints the whole call
    of a layer whose class's ``forward`` was replaced, the replacement inside. Partial fixes, as a build
    might carry them: ``keyword-grads:top-level`` and ``keyword-grads:hidden-states`` lift less;
    ``frozen-inputs:positional`` anchors only a call with a positional input; ``replaced-forward:inner``
    checkpoints the forward a replacement calls, whenever the layer is not inside its own checkpoint,
    and leaves the replacement's own work outside."""

    def install(modeling_layers) -> None:
        _LAYER_FIXES.add(fix)
        base = modeling_layers.GradientCheckpointingLayer
        if "_devbuild" in vars(base):
            return
        import threading

        torch = sys.modules["torch"]
        pytree = sys.modules["torch.utils._pytree"]
        inside = threading.local()

        def checkpointed(self, forward, args, kwargs):
            """``forward(self, *args, **kwargs)`` through the layer's checkpoint function, with the fixes."""
            run = forward.__get__(self) if "finds-layer" in _LAYER_FIXES else functools.partial(forward, self)
            lifted = [(name, *pytree.tree_flatten(kwargs.pop(name))) for name in _keyword_inputs(kwargs, torch)]
            extra = tuple(leaf for _name, leaves, _spec in lifted for leaf in leaves)
            anchored = (
                bool({"frozen-inputs", "frozen-inputs:positional"} & _LAYER_FIXES)
                and (bool(args) or "frozen-inputs" in _LAYER_FIXES)
                and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *extra))
                and any(p.requires_grad for p in self.parameters())
            )
            count = len(args)
            if lifted or anchored:  # a method of the layer still: the partial finds it (finds-layer)

                def run_inputs(layer, *inputs, **rest):
                    at, given = count, dict(rest)
                    for name, leaves, spec in lifted:
                        given[name] = pytree.tree_unflatten(list(inputs[at : at + len(leaves)]), spec)
                        at += len(leaves)
                    return run(*inputs[:count], **given)

                target = functools.partial(types.MethodType(run_inputs, self), **kwargs)
            else:
                target = functools.partial(run, **kwargs)
            inputs = (*args, *extra, *((torch.zeros(0, requires_grad=True),) if anchored else ()))
            inside.layer = True
            try:
                return self._gradient_checkpointing_func(target, *inputs)
            finally:
                inside.layer = False

        def checkpoints(self) -> bool:
            return self.gradient_checkpointing and self.training and torch.is_grad_enabled()

        def __init_subclass__(cls, **kwargs):
            super(base, cls).__init_subclass__(**kwargs)
            forward = cls.forward

            @functools.wraps(forward)
            def forward_with_checkpointing(self, *args, **kwargs):
                if "replaced-forward:inner" in _LAYER_FIXES or "replaced-forward" in _LAYER_FIXES:
                    outermost = not getattr(inside, "layer", False)
                else:
                    outermost = type(self).forward is forward_with_checkpointing
                if not (checkpoints(self) and outermost):
                    return forward(self, *args, **kwargs)
                return checkpointed(self, forward, args, kwargs)

            _WRAPPERS.add(forward_with_checkpointing)
            cls.forward = forward_with_checkpointing

        def __call__(self, *args, **kwargs):
            # replaced-forward: a class whose forward is no longer the wrapper checkpoints the whole call
            replaced = "replaced-forward" in _LAYER_FIXES and type(self).forward not in _WRAPPERS
            if replaced and checkpoints(self) and not getattr(inside, "layer", False):
                return checkpointed(self, torch.nn.Module.__call__, args, kwargs)
            return torch.nn.Module.__call__(self, *args, **kwargs)

        base.__init_subclass__ = classmethod(__init_subclass__)
        base.__call__ = __call__
        base._devbuild = True

    return install


#: patch name -> the (module, fix) pairs that edit its fix into upstream.
FIXES = {
    "input-grad-hook-dedupe": [("transformers.modeling_utils", _input_grads("dedupe"))],
    "frozen-tower-input-grads": [("transformers.modeling_utils", _input_grads("frozen"))],
    "ddp-find-unused-for-checkpointing": [("transformers.trainer", _ddp_sees_checkpointing(inside_the_model=True))],
    "checkpoint-function-finds-layer": [("transformers.modeling_layers", _layers("finds-layer"))],
    "reentrant-keyword-grads": [("transformers.modeling_layers", _layers("keyword-grads"))],
    "reentrant-frozen-input-grads": [("transformers.modeling_layers", _layers("frozen-inputs"))],
    "replaced-forward-keeps-checkpointing": [("transformers.modeling_layers", _layers("replaced-forward"))],
    "load-keeps-requires-grad": [
        ("transformers.core_model_loading", _loading_keeps_frozen),
        ("transformers.modeling_utils", _loading_keeps_frozen),
    ],
    "checkpointing-call-signature": [("trl.models.utils", _trl_re_enables(fits_every_signature=True))],
    "trl-restore-on-error": [("trl.models.utils", _trl_restores_on_error)],
    "fsdp2-checkpoint-rng-state": [("accelerate.utils.fsdp_utils", _fsdp2_keeps_rng_state(with_offload=True))],
    "kbit-prepare-keeps-checkpointing": [("peft.utils.other", _kbit_keeps_checkpointing(pattern=True))],
    "checkpoint-kwargs-clean": [("transformers.modeling_utils", _kwargs_become_parameters(passed_on=True))],
    "checkpointing-restore": [("transformers.modeling_utils", _restores_checkpointing)],
    "checkpointing-args-aliases": [("transformers.training_args", _aliases_stay_one(kwargs_too=True))],
    "trl-selective-reaches-peft": [
        ("trl.models.selective_activation_checkpointing", _selective_reaches_the_inner_model)
    ],
}

#: A partial fix -> (the patch whose bug it leaves partly there, the (module, fix) pairs): what a build
#: could carry that fixes some of the cases the patch fixes and not the rest. The patch's probe finds
#: the rest, and the patch applies for it.
PARTIAL = {
    "keyword-grads:hidden-states": ("reentrant-keyword-grads", [("transformers.modeling_layers", _layers("keyword-grads:hidden-states"))]),
    "keyword-grads:top-level": ("reentrant-keyword-grads", [("transformers.modeling_layers", _layers("keyword-grads:top-level"))]),
    "frozen-inputs:positional": ("reentrant-frozen-input-grads", [("transformers.modeling_layers", _layers("frozen-inputs:positional"))]),
    "replaced-forward:inner": ("replaced-forward-keeps-checkpointing", [("transformers.modeling_layers", _layers("replaced-forward:inner"))]),
    "input-grads:dedupe-first": ("input-grad-hook-dedupe", [("transformers.modeling_utils", _input_grads("dedupe:first"))]),
    "kwargs:dropped": ("checkpoint-kwargs-clean", [("transformers.modeling_utils", _kwargs_become_parameters(passed_on=False))]),
    "aliases:flag-only": ("checkpointing-args-aliases", [("transformers.training_args", _aliases_stay_one(kwargs_too=False))]),
    "ddp:arguments-only": ("ddp-find-unused-for-checkpointing", [("transformers.trainer", _ddp_sees_checkpointing(inside_the_model=False))]),
    "trl:by-keyword": ("checkpointing-call-signature", [("trl.models.utils", _trl_re_enables(fits_every_signature=False))]),
    "fsdp2:without-offload": ("fsdp2-checkpoint-rng-state", [("accelerate.utils.fsdp_utils", _fsdp2_keeps_rng_state(with_offload=False))]),
    "kbit:kwargs-only": ("kbit-prepare-keeps-checkpointing", [("peft.utils.other", _kbit_keeps_checkpointing(pattern=False))]),
}  # fmt: skip
PARTIAL_FIXES = {name: pairs for name, (_patch, pairs) in PARTIAL.items()}
