"""The stand-in patchers do what their docstrings say, on the installed libraries: the location
changed to the patcher's object, the object it replaced called (wrap) or not (replace, noop), and
``undo()`` puts every location back. How the shim reacts to them is tested elsewhere."""

import functools
import sys
import types

import pytest
import torch

from shim.tools.targets import quiet_transformers
from tests.coexistence import patchers
from tests.coexistence.patchers import PATTERNS
from tests.conftest import run_python
from tests.tinymodels import tiny_llama

quiet_transformers()
ENABLE = "gradient_checkpointing_enable"
SPEC = "transformers.modeling_utils:PreTrainedModel.enable_input_require_grads"


@pytest.fixture
def patched(monkeypatch):
    """``patched(patcher, *args)`` applies a patcher; every one is undone, last first, before the
    spies (``monkeypatch``) come off."""
    handles = []

    def apply(patcher, *args, **kwargs):
        handle = patcher(*args, **kwargs)
        handles.append(handle)
        return handle

    yield apply
    for handle in reversed(handles):
        handle.undo()


@pytest.fixture
def spy(monkeypatch):
    """``spy(owner, name)`` puts a counting pass-through where ``owner.name`` is; returns the counter
    (a list: one entry per call). A patcher applied afterwards finds the spy as the original."""

    def install(owner, name):
        original = getattr(owner, name)
        calls = []

        @functools.wraps(original)  # inspect.getsource reads through it, as through the shim's layer
        def counting(*args, **kwargs):
            calls.append(args)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
        return calls

    return install


@pytest.fixture
def consumer(monkeypatch):
    """A loaded ``trl.*`` module that imported ``names`` from ``trl.models.utils`` by reference."""

    def make(*names):
        import trl.models.utils

        module = types.ModuleType("trl._coexistence_consumer")
        for name in names:
            setattr(module, name, getattr(trl.models.utils, name))
        monkeypatch.setitem(sys.modules, module.__name__, module)
        return module

    return make


def quietly(function, *args, **kwargs):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return function(*args, **kwargs)


def ids():
    return torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))


def test_patterns_table_is_consistent():
    for name, (patcher, spec, kind) in PATTERNS.items():
        assert callable(patcher), name
        assert kind in {"replace", "noop", "wrap"}, name
        assert spec == "<spec>" or ":" in spec, name
        assert patcher.__doc__ and "Kind: " + kind in " ".join(patcher.__doc__.split()), name


# ---------------------------------------------------------------------------- unsloth


def test_unsloth_enable_input_require_grads_replaces_on_the_class(patched, spy):
    from transformers import PreTrainedModel

    original = spy(PreTrainedModel, "enable_input_require_grads")
    before = vars(PreTrainedModel)["enable_input_require_grads"]
    handle = patched(patchers.unsloth_enable_input_require_grads)

    assert handle.applied, "the guard reads 'for module in self.modules()' in the installed transformers"
    assert vars(PreTrainedModel)["enable_input_require_grads"] is handle.replacement
    assert not hasattr(handle.replacement, "__wrapped__")
    model = tiny_llama(2)
    model.enable_input_require_grads()
    assert (handle.calls, len(original)) == (1, 0)
    assert len(model._require_grads_hooks) == 1 and model._require_grads_hook is model._require_grads_hooks[0]
    model.requires_grad_(False)
    assert model.get_input_embeddings()(ids()).requires_grad

    handle.undo()
    assert vars(PreTrainedModel)["enable_input_require_grads"] is before


def test_unsloth_enable_input_require_grads_skips_behind_a_plain_wrapper(patched):
    """The guard reads the source ``inspect.getsource`` finds: a wrapper without ``__wrapped__`` on
    top hides transformers' code, and unsloth leaves the method alone."""
    from transformers import PreTrainedModel

    patched(patchers.own_wrap, SPEC, wraps=False)
    held = vars(PreTrainedModel)["enable_input_require_grads"]
    assert not patchers.unsloth_enable_input_require_grads().applied
    assert vars(PreTrainedModel)["enable_input_require_grads"] is held


def test_unsloth_trl_noop_rebinds_every_loaded_trl_module(patched, spy, consumer):
    import trl.models.utils

    original = spy(trl.models.utils, "disable_gradient_checkpointing")
    module = consumer("disable_gradient_checkpointing")
    loaded = {
        name: vars(m)["disable_gradient_checkpointing"]
        for name, m in list(sys.modules.items())
        if name.startswith("trl.") and m is not None and getattr(m, "disable_gradient_checkpointing", None) is not None
    }
    handle = patched(patchers.unsloth_trl_disable_gradient_checkpointing_noop)

    noop = handle.replacement
    assert handle.applied and noop._unsloth_noop_patched is True
    assert trl.models.utils.disable_gradient_checkpointing is noop and module.disable_gradient_checkpointing is noop
    assert all(vars(sys.modules[name])["disable_gradient_checkpointing"] is noop for name in loaded)
    model = tiny_llama(2)
    quietly(getattr(model, ENABLE))
    with noop(model, {"use_reentrant": False}) as entered:
        assert entered is None
        assert model.is_gradient_checkpointing, "the no-op leaves checkpointing on"
    assert (handle.calls, len(original)) == (1, 0)
    assert not patchers.unsloth_trl_disable_gradient_checkpointing_noop().applied, "marked: applied once"

    handle.undo()
    assert all(vars(sys.modules[name])["disable_gradient_checkpointing"] is held for name, held in loaded.items())


def test_unsloth_trl_noop_reaches_a_trainer_module():
    """#4934's case: grpo_trainer imported the name by reference before unsloth patched."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    before = grpo.disable_gradient_checkpointing
    handle = patchers.unsloth_trl_disable_gradient_checkpointing_noop()
    try:
        assert grpo.disable_gradient_checkpointing is handle.replacement
    finally:
        handle.undo()
    assert grpo.disable_gradient_checkpointing is before


def test_unsloth_unwrap_wraps_in_the_trainer_modules_only(patched, monkeypatch):
    import contextlib

    import trl.models.utils

    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    entered = []

    @contextlib.contextmanager
    def original(model, accelerator, **kwargs):
        entered.append((model, accelerator, kwargs))
        yield "unwrapped"

    monkeypatch.setattr(trl.models.utils, "unwrap_model_for_generation", original)
    before = vars(grpo)["unwrap_model_for_generation"]
    handle = patched(patchers.unsloth_unwrap_model_for_generation, ("grpo_trainer",))

    assert grpo.unwrap_model_for_generation is handle.replacement
    assert trl.models.utils.unwrap_model_for_generation is original
    with handle.replacement("model", "accelerator", gather_deepspeed3_params=False) as unwrapped:
        assert unwrapped == "unwrapped"
    assert entered == [("model", "accelerator", {"gather_deepspeed3_params": False})]
    assert (handle.calls, handle.forwarded) == (1, 1)

    handle.undo()
    assert vars(grpo)["unwrap_model_for_generation"] is before


def test_unsloth_decoder_layer_forward_replaces_without_calling(patched, spy):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    model = tiny_llama(2)
    reference = model(ids()).logits
    reference.sum().backward()
    reference_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    original = spy(LlamaDecoderLayer, "forward")
    before = vars(LlamaDecoderLayer)["forward"]
    handle = patched(patchers.unsloth_decoder_layer_forward)

    assert vars(LlamaDecoderLayer)["forward"] is handle.replacement
    logits = model(ids()).logits
    logits.sum().backward()
    assert torch.allclose(logits, reference, atol=1e-6)
    assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), reference_grads))
    assert (handle.calls, len(original)) == (2, 0)

    handle.undo()
    assert vars(LlamaDecoderLayer)["forward"] is before


def _layer_function():
    torch.manual_seed(0)
    weight = torch.randn(4, 4, requires_grad=True)

    def forward(x, scale=1.0):
        return torch.tanh(x @ weight) * scale

    return weight, functools.partial(forward, scale=2.0)


def _check_recomputes(checkpoint_function, **kwargs):
    """``checkpoint_function(partial, x)`` gives forward's output and gradients."""
    weight, function = _layer_function()
    x = torch.randn(2, 4, requires_grad=True)
    expected = function(x)
    expected.sum().backward()
    expected_grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    out = checkpoint_function(function, x, **kwargs)
    out.sum().backward()
    assert torch.allclose(out, expected)
    assert torch.allclose(x.grad, expected_grads[0]) and torch.allclose(weight.grad, expected_grads[1])


def test_unsloth_zoo_checkpoint_replaces_torch_and_transformers_names(patched, spy):
    import torch.utils.checkpoint
    import transformers.modeling_utils

    original = spy(torch.utils.checkpoint, "checkpoint")
    spied = torch.utils.checkpoint.checkpoint
    transformers_before = transformers.modeling_utils.checkpoint
    handle = patched(patchers.unsloth_zoo_checkpoint)

    assert torch.utils.checkpoint.checkpoint is handle.replacement
    assert transformers.modeling_utils.checkpoint is handle.replacement
    assert torch.utils.checkpoint._old_checkpoint is spied
    _check_recomputes(handle.replacement, use_reentrant=False, preserve_rng_state=False)
    assert (handle.calls, len(original)) == (1, 0), "keywords ignored; torch's checkpoint never called"
    assert not patchers.unsloth_zoo_checkpoint().applied, "guarded by the function's __name__"

    handle.undo()
    assert torch.utils.checkpoint.checkpoint is spied and transformers.modeling_utils.checkpoint is transformers_before
    assert not hasattr(torch.utils.checkpoint, "_old_checkpoint")


def test_unsloth_instance_enable_forces_reentrant_keyword_only(patched):
    model = tiny_llama(2)
    handle = patched(patchers.unsloth_instance_checkpointing_enable, model)

    assert vars(model)["gradient_checkpointing_enable"] is handle.replacement
    kwargs = {"use_reentrant": False}
    quietly(model.gradient_checkpointing_enable, gradient_checkpointing_kwargs=kwargs)
    assert model.is_gradient_checkpointing and kwargs == {"use_reentrant": True}, "the caller's dict is changed"
    assert (handle.calls, handle.forwarded) == (1, 1)
    with pytest.raises(TypeError):
        model.gradient_checkpointing_enable({"use_reentrant": False})  # trl re-enables positionally

    handle.undo()
    assert "gradient_checkpointing_enable" not in vars(model)


# ---------------------------------------------------------------------------- axolotl


def test_axolotl_layer_call_marks_and_calls_through(patched):
    from transformers.modeling_layers import GradientCheckpointingLayer

    assert "__call__" not in vars(GradientCheckpointingLayer)
    handle = patched(patchers.axolotl_layer_call)
    assert vars(GradientCheckpointingLayer)["__call__"] is handle.replacement

    model = tiny_llama(2).train()
    quietly(getattr(model, ENABLE))
    hooked = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda *args: hooked.append(1))
    with handle.marks.on():
        model(ids()).logits.sum().backward()
    marked_inside = len(handle.marks.marked)
    model(ids())
    assert marked_inside == 2 and len(handle.marks.marked) == 2, "marks only inside the offload context"
    assert handle.calls == handle.forwarded >= 4 and len(hooked) >= 4, "nn.Module.__call__ ran each time"

    handle.undo()
    assert "__call__" not in vars(GradientCheckpointingLayer)


def _tiny_gc_layer():
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Tiny(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.linear(x))

    torch.manual_seed(0)
    return Tiny()


def test_axolotl_modeling_utils_checkpoint_replaces_transformers_name_only(patched, spy):
    import torch.utils.checkpoint
    import transformers.modeling_utils

    original = spy(torch.utils.checkpoint, "checkpoint")
    torch_before = torch.utils.checkpoint.checkpoint
    transformers_before = transformers.modeling_utils.checkpoint
    handle = patched(patchers.axolotl_modeling_utils_checkpoint)

    assert transformers.modeling_utils.checkpoint is handle.replacement
    assert torch.utils.checkpoint.checkpoint is torch_before
    layer = _tiny_gc_layer()
    x = torch.randn(2, 4, requires_grad=True)
    expected = layer(x)
    expected.sum().backward()
    expected_grads = (x.grad.clone(), layer.linear.weight.grad.clone())
    x.grad = layer.linear.weight.grad = None
    out = handle.replacement(functools.partial(layer.forward), x, use_reentrant=True)  # a bound method, as in 4.x
    out.sum().backward()
    assert torch.allclose(out, expected)
    assert torch.allclose(x.grad, expected_grads[0]) and torch.allclose(layer.linear.weight.grad, expected_grads[1])
    assert (handle.calls, len(original)) == (1, 0)
    with pytest.raises(TypeError):
        handle.replacement(functools.partial(layer.forward), x, preserve_rng_state=False)
    with pytest.raises(AttributeError, match="__self__"):
        handle.replacement(functools.partial(type(layer).forward, layer), x)  # what 5.x layers hand over

    handle.undo()
    assert transformers.modeling_utils.checkpoint is transformers_before


def test_axolotl_offload_wrapper_fails_on_installed_transformers_without_the_shim():
    """Ground truth without the shim: the installed transformers hands the checkpoint function a
    ``partial`` of a plain function, where axolotl's wrapper looks for a bound method's ``__self__``."""
    code = """
        import warnings
        warnings.simplefilter("ignore")
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from tests.coexistence import patchers
        handle = patchers.axolotl_modeling_utils_checkpoint()
        config = LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64,
        )
        model = LlamaForCausalLM(config).train()
        model.gradient_checkpointing_enable()
        try:
            model(torch.randint(0, 64, (1, 6)))
        except AttributeError as error:
            print("AttributeError", error)
        assert "shim" not in __import__("sys").modules
    """
    assert "has no attribute '__self__'" in run_python(code, torch_first=True).stdout


def test_axolotl_prepare_model_for_kbit_training_reexecutes_a_copy(patched, spy):
    import peft
    import peft.utils.other

    original = spy(peft.utils.other, "prepare_model_for_kbit_training")
    spied = peft.utils.other.prepare_model_for_kbit_training
    package_export = peft.prepare_model_for_kbit_training
    module = types.ModuleType("coexistence_axolotl_loaders_model")
    module.prepare_model_for_kbit_training = spied
    handle = patched(patchers.axolotl_prepare_model_for_kbit_training, module)

    assert handle.applied, "the upcast loop is verbatim in the installed peft"
    fixed = handle.replacement
    assert peft.utils.other.prepare_model_for_kbit_training is fixed and module.prepare_model_for_kbit_training is fixed
    assert peft.prepare_model_for_kbit_training is package_export
    assert fixed.__name__ == "fixed_prepare_model_for_kbit_training" and fixed.__code__.co_filename == "<string>"
    assert not hasattr(fixed, "__wrapped__")
    assert isinstance(peft.utils.other._original_create_accelerator_and_postprocess, str)
    model = tiny_llama(2).to(torch.bfloat16)
    fixed(model, use_gradient_checkpointing=False)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["model.embed_tokens.weight"] == dtypes["lm_head.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == torch.float32
    assert len(original) == 0

    handle.undo()
    assert peft.utils.other.prepare_model_for_kbit_training is spied and module.prepare_model_for_kbit_training is spied
    assert not hasattr(peft.utils.other, "_original_create_accelerator_and_postprocess")


def test_axolotl_checkpoint_wrapper_setattr_forwards_ds_attributes(patched):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapper = CheckpointWrapper(torch.nn.Linear(2, 2))
    handle = patched(patchers.axolotl_checkpoint_wrapper_setattr)

    assert vars(CheckpointWrapper)["__setattr__"] is handle.replacement
    assert CheckpointWrapper._axolotl_setattr_patched is True
    wrapper.ds_grads_remaining = 0
    wrapper.other = 1
    inner = wrapper._checkpoint_wrapped_module
    assert "ds_grads_remaining" in vars(inner) and "ds_grads_remaining" not in vars(wrapper)
    assert wrapper.ds_grads_remaining == 0, "read back through CheckpointWrapper.__getattr__"
    assert vars(wrapper)["other"] == 1
    assert (handle.calls, handle.forwarded) == (2, 1)
    assert not patchers.axolotl_checkpoint_wrapper_setattr().applied, "marked: applied once"

    handle.undo()
    assert "__setattr__" not in vars(CheckpointWrapper)
    assert not hasattr(CheckpointWrapper, "_axolotl_setattr_patched")


# ---------------------------------------------------------------------------- own patches


@pytest.mark.parametrize("wraps", [True, False])
def test_own_wrap_calls_through(patched, spy, wraps):
    from transformers import PreTrainedModel

    original = spy(PreTrainedModel, "enable_input_require_grads")
    spied = vars(PreTrainedModel)["enable_input_require_grads"]
    handle = patched(patchers.own_wrap, SPEC, wraps=wraps)

    assert vars(PreTrainedModel)["enable_input_require_grads"] is handle.replacement
    assert (getattr(handle.replacement, "__wrapped__", None) is not None) is wraps
    model = tiny_llama(2)
    model.enable_input_require_grads()
    assert (handle.calls, handle.forwarded, len(original)) == (1, 1, 1)
    assert len(model._require_grads_hooks) == 1

    handle.undo()
    assert vars(PreTrainedModel)["enable_input_require_grads"] is spied


def test_own_noop_and_replace_do_not_call_through(patched, spy):
    from transformers import PreTrainedModel

    original = spy(PreTrainedModel, "enable_input_require_grads")
    model = tiny_llama(2)
    noop = patched(patchers.own_noop, SPEC)
    assert model.enable_input_require_grads() is None and not hasattr(model, "_require_grads_hooks")
    replace = patched(patchers.own_replace, SPEC, lambda self: "mine")
    assert model.enable_input_require_grads() == "mine"
    assert (noop.calls, replace.calls, len(original)) == (1, 1, 0)
