"""Builds between releases, for the tests' fresh interpreters: libraries that say a dev version, and
upstream functions replaced by copies with a fix edited in, as a git build of a release to come
would carry it. Installed before ``import shim``, so that the shim meets the module as the import
system hands it over: the fix is in the module's body, before any hook of the shim's runs::

    from tests import devbuild
    devbuild.install(devbuild.DEV_VERSIONS, fixes=["input-grad-hook-dedupe"])
    import shim

The fixes are written here in the tests' words, each the smallest change that removes the bug the
way upstream would (upstream has none of them yet; peft's and DeepSpeed's real fixes are measured on
their releases). Nothing here is shipped.
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
    """Make the libraries of ``versions`` say those versions, and edit the fixes of the patches named
    in ``fixes`` into upstream's code, at their modules' import (call it before ``import shim``)."""
    by_module: dict = {}
    for name in fixes:
        for module, fix in FIXES[name]:
            by_module.setdefault(module, []).append(fix)
    chained = {module: (lambda m, fs=tuple(fs): [f(m) for f in fs]) for module, fs in by_module.items()}
    sys.meta_path.insert(0, _Finder(dict(versions), chained))


# -- the fixes, edited in --------------------------------------------------------------------------


_INPUT_GRAD_FIXES: set = set()  # which of the two fixes the copy of enable_input_require_grads has


def _input_grads(fix: str):
    """``enable_input_require_grads`` as 5.25 has it, with ``fix`` edited in: ``dedupe`` removes the hooks
    the model still holds before adding new ones; ``frozen`` hooks no sub-model without a trainable
    parameter."""

    def install(modeling_utils) -> None:
        _INPUT_GRAD_FIXES.add(fix)
        cls = modeling_utils.PreTrainedModel
        if getattr(cls.enable_input_require_grads, "_devbuild", False):
            return

        def enable_input_require_grads(self):
            if "dedupe" in _INPUT_GRAD_FIXES:
                for handle in getattr(self, "_require_grads_hooks", None) or ():
                    handle.remove()

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


def _trl_re_enables_by_keyword(utils) -> None:
    @contextlib.contextmanager
    def disable_gradient_checkpointing(model, gradient_checkpointing_kwargs=None):
        was_enabled = model.is_gradient_checkpointing
        if was_enabled:
            model.gradient_checkpointing_disable()
        try:
            yield
        finally:
            if was_enabled:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    utils.disable_gradient_checkpointing = disable_gradient_checkpointing


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


def _fsdp2_keeps_rng_state(fsdp_utils) -> None:
    original = fsdp_utils.fsdp2_apply_ac

    @functools.wraps(original)
    def fsdp2_apply_ac(accelerator, model):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        model = original(accelerator, model)
        for module in model.modules():
            if (
                isinstance(module, CheckpointWrapper)
                and module.checkpoint_fn.keywords.get("preserve_rng_state") is False
            ):
                keywords = {**module.checkpoint_fn.keywords, "preserve_rng_state": True}
                module.checkpoint_fn = functools.partial(module.checkpoint_fn.func, **keywords)
        return model

    fsdp_utils.fsdp2_apply_ac = fsdp2_apply_ac


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


def _kbit_keeps_checkpointing(other) -> None:
    original = other.prepare_model_for_kbit_training

    @functools.wraps(original)
    def prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=None, **kw
    ):
        states = _layer_states(model)
        result = original(model, use_gradient_checkpointing, gradient_checkpointing_kwargs, **kw)
        if gradient_checkpointing_kwargs is None and any(flag for _, flag, _ in states):
            _put_back(states)
        return result

    other.prepare_model_for_kbit_training = prepare_model_for_kbit_training


def _kwargs_become_parameters(modeling_utils) -> None:
    cls = modeling_utils.PreTrainedModel
    original = cls._activation_checkpointing_enable

    def _activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        kwargs = dict(activation_checkpointing_kwargs or {})
        every_n_layers = kwargs.pop("every_n_layers", every_n_layers)
        offload = kwargs.pop("offload", offload)
        kwargs.pop("selective", None)
        return original(self, kwargs or None, every_n_layers, offload)

    cls._activation_checkpointing_enable = _activation_checkpointing_enable


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


def _aliases_stay_one(training_args) -> None:
    cls = training_args.TrainingArguments
    pairs = {
        "gradient_checkpointing": "activation_checkpointing",
        "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
    }
    pairs |= {new: old for old, new in pairs.items()}
    original = cls.__setattr__

    def __setattr__(self, name, value):
        original(self, name, value)
        partner = pairs.get(name)
        if partner is not None and partner in self.__dict__ and name in self.__dict__:
            self.__dict__[partner] = value

    cls.__setattr__ = __setattr__


def _selective_reaches_the_inner_model(selective) -> None:
    original = selective.enable_selective_activation_checkpointing

    @functools.wraps(original)
    def enable_selective_activation_checkpointing(model):
        original(model)
        inner = getattr(getattr(model, "activation_checkpointing_enable", None), "__self__", None)
        if inner is not None and inner is not model and "gradient_checkpointing_enable" not in vars(inner):
            original(inner)

    selective.enable_selective_activation_checkpointing = enable_selective_activation_checkpointing


def _ddp_sees_checkpointing_inside(trainer) -> None:
    """The DDP decision looks at the model's modules, wrapped or not: checkpointing anywhere in it
    means ``find_unused_parameters=False`` (upstream asks only a ``PreTrainedModel``)."""
    cls = trainer.Trainer
    original = cls._build_accelerator_args

    def _build_accelerator_args(self, **kwargs):
        built = original(self, **kwargs)
        model = getattr(self, "model", None)
        checkpointing = bool(getattr(self.args, "activation_checkpointing", None)) or any(
            getattr(module, "gradient_checkpointing", False) for module in getattr(model, "modules", tuple)()
        )
        if self.args.ddp_find_unused_parameters is None and checkpointing:
            for handler in built.get("kwargs_handlers") or ():
                if isinstance(handler, trainer.DistributedDataParallelKwargs):
                    handler.find_unused_parameters = False
        return built

    cls._build_accelerator_args = _build_accelerator_args


_LAYER_FIXES: set = set()  # which fixes the copy of GradientCheckpointingLayer's forward wrapper has


def _layers(fix: str):
    """``GradientCheckpointingLayer.__init_subclass__``'s forward wrapper as 5.25 has it (the cache
    arguments left out), with ``fix`` edited in: ``finds-layer`` hands the checkpoint a partial of the
    bound forward (``func.func.__self__`` is the layer); ``keyword-grads`` passes keyword tensors that
    require grad as checkpoint inputs; ``frozen-inputs`` adds a zero-size input that requires grad where
    none does and the layer has a trainable parameter; ``replaced-forward`` checkpoints whenever the
    layer is not inside its own checkpoint, however its class's ``forward`` was replaced."""

    def install(modeling_layers) -> None:
        _LAYER_FIXES.add(fix)
        base = modeling_layers.GradientCheckpointingLayer
        if "_devbuild" in vars(base):
            return
        import threading

        torch = sys.modules["torch"]
        inside = threading.local()

        def __init_subclass__(cls, **kwargs):
            super(base, cls).__init_subclass__(**kwargs)
            forward = cls.forward

            @functools.wraps(forward)
            def forward_with_checkpointing(self, *args, **kwargs):
                if "replaced-forward" in _LAYER_FIXES:
                    outermost = not getattr(inside, "layer", False)
                else:
                    outermost = type(self).forward is forward_with_checkpointing
                if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled() and outermost):
                    return forward(self, *args, **kwargs)
                run = forward.__get__(self) if "finds-layer" in _LAYER_FIXES else functools.partial(forward, self)
                lifted = []
                if "keyword-grads" in _LAYER_FIXES:
                    lifted = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
                extra = tuple(kwargs.pop(name) for name in lifted)
                anchored = (
                    "frozen-inputs" in _LAYER_FIXES
                    and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *extra))
                    and any(p.requires_grad for p in self.parameters())
                )
                count = len(args)
                if lifted or anchored:  # a method of the layer still: the partial finds it (finds-layer)

                    def run_inputs(layer, *inputs, _run=run, _kwargs=kwargs):
                        return _run(*inputs[:count], **_kwargs, **dict(zip(lifted, inputs[count:])))

                    target = functools.partial(types.MethodType(run_inputs, self))
                else:
                    target = functools.partial(run, **kwargs)
                inputs = (*args, *extra, *((torch.zeros(0, requires_grad=True),) if anchored else ()))
                inside.layer = True
                try:
                    return self._gradient_checkpointing_func(target, *inputs)
                finally:
                    inside.layer = False

            cls.forward = forward_with_checkpointing

        base.__init_subclass__ = classmethod(__init_subclass__)
        base._devbuild = True

    return install


#: patch name -> the (module, fix) pairs that edit its fix into upstream.
FIXES = {
    "input-grad-hook-dedupe": [("transformers.modeling_utils", _input_grads("dedupe"))],
    "frozen-tower-input-grads": [("transformers.modeling_utils", _input_grads("frozen"))],
    "ddp-find-unused-for-checkpointing": [("transformers.trainer", _ddp_sees_checkpointing_inside)],
    "checkpoint-function-finds-layer": [("transformers.modeling_layers", _layers("finds-layer"))],
    "reentrant-keyword-grads": [("transformers.modeling_layers", _layers("keyword-grads"))],
    "reentrant-frozen-input-grads": [("transformers.modeling_layers", _layers("frozen-inputs"))],
    "replaced-forward-keeps-checkpointing": [("transformers.modeling_layers", _layers("replaced-forward"))],
    "load-keeps-requires-grad": [
        ("transformers.core_model_loading", _loading_keeps_frozen),
        ("transformers.modeling_utils", _loading_keeps_frozen),
    ],
    "checkpointing-call-signature": [("trl.models.utils", _trl_re_enables_by_keyword)],
    "trl-restore-on-error": [("trl.models.utils", _trl_restores_on_error)],
    "fsdp2-checkpoint-rng-state": [("accelerate.utils.fsdp_utils", _fsdp2_keeps_rng_state)],
    "kbit-prepare-keeps-checkpointing": [("peft.utils.other", _kbit_keeps_checkpointing)],
    "checkpoint-kwargs-clean": [("transformers.modeling_utils", _kwargs_become_parameters)],
    "checkpointing-restore": [("transformers.modeling_utils", _restores_checkpointing)],
    "checkpointing-args-aliases": [("transformers.training_args", _aliases_stay_one)],
    "trl-selective-reaches-peft": [
        ("trl.models.selective_activation_checkpointing", _selective_reaches_the_inner_model)
    ],
}
