"""kbit-prepare-keeps-checkpointing: peft's k-bit preparation keeps the checkpointing
configuration a model already has.

Each case runs ``peft.prepare_model_for_kbit_training`` on a tiny Llama flagged as loaded in 4 bit
(``tests.tinymodels.kbit_flagged_llama``), first with the patch off on the installed upstream
release, then with it on. What is compared is what reaches ``torch.utils.checkpoint.checkpoint``: the
kwargs each checkpointed layer call hands it (a spy on transformers' own ``checkpoint``), each
module's flag and checkpoint partial, and torch's warning about a missing ``use_reentrant``.
"""

import importlib.util
import warnings

import pytest

import shim
from tests import steps
from tests import tinymodels as models
from tests.conftest import run_python
from tests.patches.checkpointing_cases import configure, describe, layer_flags, quietly, supports
from tests.probes import bug_found
from tests.tinymodels import causal_lm_grads

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

NAME = "kbit-prepare-keeps-checkpointing"
TORCH_WARNING = "use_reentrant parameter should be passed explicitly"
DEFAULT = object()  # enable without kwargs: transformers' own default


@pytest.fixture
def spy(monkeypatch):
    """The kwargs of every call of ``torch.utils.checkpoint.checkpoint`` from a checkpointed layer.

    transformers builds each layer's partial from its module-level ``checkpoint`` (the offload
    closure looks it up at call time too), so a spy in its place sees what torch is handed."""
    import transformers.modeling_utils as modeling_utils

    calls = []
    real = modeling_utils.checkpoint

    def checkpoint(function, *args, **kwargs):
        calls.append(dict(kwargs))
        return real(function, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", checkpoint)
    return calls


def prepare(config=None, every_n_layers=1, offload=False, /, **prepare_kwargs):
    """A k-bit flagged model, checkpointing configured first unless ``config`` is ``None``, then
    peft's preparation: ``(model, what it checkpointed with before, after)``."""
    model = models.kbit_flagged_llama()
    if config is DEFAULT:
        configure(model, None, every_n_layers, offload)
    elif config is not None:
        configure(model, config, every_n_layers, offload)
    before = describe(model)
    quietly(peft.prepare_model_for_kbit_training, model, **prepare_kwargs)
    return model, before, describe(model)


def train_step(model, calls) -> tuple[set, list[str]]:
    """One forward and backward: the distinct kwargs torch's checkpoint got, and torch's warnings."""
    calls.clear()
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    return {tuple(sorted(kwargs.items())) for kwargs in calls}, [str(w.message) for w in caught]


NO_RNG = {"use_reentrant": False, "preserve_rng_state": False}
CONFIGS = {
    "use_reentrant=False, no rng state": (NO_RNG, 1, False),
    "use_reentrant=True": ({"use_reentrant": True}, 1, False),
    "transformers' default": (DEFAULT, 1, False),
    "every_n_layers=2": ({"use_reentrant": False}, 2, False),
    "offload": ({"use_reentrant": False}, 1, True),
}


def config_params():
    params = []
    for name, config in CONFIGS.items():
        marks = []
        if config[1] != 1 and not supports("every_n_layers"):
            marks.append(pytest.mark.skip(reason="version rule: every_n_layers exists from transformers 5.16"))
        if config[2] and not supports("offload"):
            marks.append(pytest.mark.skip(reason="version rule: offload exists from transformers 5.17"))
        params.append(pytest.param(*config, marks=marks, id=name))
    return params


@pytest.mark.parametrize("config, every_n_layers, offload", config_params())
def test_prepare_keeps_the_configuration_the_model_has(spy, ledger, config, every_n_layers, offload):
    trains = not offload  # offload pins host memory: no allocator for it on a CPU-only machine
    with shim.disabled(NAME):
        model, before, after = prepare(config, every_n_layers, offload)
        assert after != before, "bug: upstream re-enables with {} and drops the configuration"
        assert all(kwargs == {} for _flag, _function, kwargs in after.values())
        assert layer_flags(model) == [True] * 4
        if trains:
            reached, upstream_warnings = train_step(model, spy)
            assert reached == {()}, "bug: torch's checkpoint gets no kwargs at all, so its default (reentrant) runs"
            assert any(TORCH_WARNING in message for message in upstream_warnings)
    assert ledger(NAME) == (0, "")

    model, before, after = prepare(config, every_n_layers, offload)
    assert after == before
    assert layer_flags(model) == [index % every_n_layers == 0 for index in range(4)]
    if trains:
        reached, patched_warnings = train_step(model, spy)
        layer = next(state for name, state in before.items() if name.startswith("model.layers."))
        assert reached == {tuple(sorted(layer[2].items()))}
        assert not any(TORCH_WARNING in message for message in patched_warnings)
    assert ledger(NAME)[0] == 1


def test_the_kept_configuration_trains_with_the_gradients_of_no_checkpointing():
    """QLoRA as a script runs it: prepare, then a LoRA adapter; gradients as without checkpointing."""
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def lora_grads(config, **prepare_kwargs):
        model, _before, _after = prepare(config, **prepare_kwargs)
        torch.manual_seed(1)
        lora = peft.get_peft_model(model, models.lora_config(init_lora_weights=False))
        return model, causal_lm_grads(lora, input_ids)

    _plain, reference = lora_grads(None, use_gradient_checkpointing=False)
    model, grads = lora_grads(NO_RNG)
    assert describe(model)["model.layers.0"][2] == NO_RNG
    assert reference and all(grad is not None for grad in grads.values())
    assert steps.wrong_grads(reference, grads) == []


@pytest.mark.parametrize("explicit", [{"use_reentrant": True}, {}, NO_RNG], ids=repr)
def test_kwargs_the_caller_passes_are_used_as_upstream_uses_them(ledger, explicit):
    with shim.disabled(NAME):
        _model, _before, upstream = prepare({"use_reentrant": False}, gradient_checkpointing_kwargs=explicit)
    model, _before, patched = prepare({"use_reentrant": False}, gradient_checkpointing_kwargs=explicit)
    assert patched == upstream
    assert describe(model)["model.layers.0"][2] == explicit
    assert ledger(NAME) == (0, "")


def test_a_fresh_model_gets_peft_s_own_configuration(ledger):
    """No configuration to keep: peft's ``{}`` (torch's default, reentrant) as upstream, no effect."""
    with shim.disabled(NAME):
        _model, fresh, upstream = prepare(None)
    model, _fresh, patched = prepare(None)
    assert not any(flag for flag, _function, _kwargs in fresh.values())
    assert patched == upstream
    assert describe(model)["model.layers.0"][1:] == ("checkpoint", {})
    assert ledger(NAME) == (0, "")


def test_calls_that_do_not_re_enable_are_left_alone(ledger):
    """``use_gradient_checkpointing=False``, and a model that is not quantized: peft leaves
    checkpointing as it is, and so does the shim."""
    for kwargs in ({"use_gradient_checkpointing": False}, {}):
        model = models.kbit_flagged_llama()
        if not kwargs:
            model.is_loaded_in_4bit = False
        configure(model, NO_RNG)
        before = describe(model)
        quietly(peft.prepare_model_for_kbit_training, model, **kwargs)
        assert describe(model) == before
    assert ledger(NAME) == (0, "")


def test_positional_arguments_are_read_as_by_name():
    model = models.kbit_flagged_llama()
    configure(model, NO_RNG)
    quietly(peft.prepare_model_for_kbit_training, model, True, None)
    assert describe(model)["model.layers.0"][2] == NO_RNG

    model = models.kbit_flagged_llama()
    configure(model, NO_RNG)
    quietly(peft.prepare_model_for_kbit_training, model, True, {"use_reentrant": True})
    assert describe(model)["model.layers.0"][2] == {"use_reentrant": True}


def test_the_effect_names_the_model_what_peft_set_and_what_was_kept(ledger):
    prepare(NO_RNG)
    count, last = ledger(NAME)
    modules = sum(1 for module in models.kbit_flagged_llama().modules() if hasattr(module, "gradient_checkpointing"))
    assert count == 1
    assert last == (
        "prepare_model_for_kbit_training re-enabled checkpointing of LlamaForCausalLM with {}; the shim kept "
        f"{NO_RNG!r} on {modules} module(s)"
    )


def test_every_public_name_of_peft_s_function_is_the_patched_one():
    """peft exports the function from ``peft.utils.other`` through ``peft.utils`` and ``peft``;
    imported after the shim (this process) each name holds the wrapped function. Imported before
    it, the shim rebinds the names (``consumers``), trl's modules that bind it by name too, and
    deactivating puts upstream's function back."""
    import peft.utils
    import peft.utils.other

    assert [name for name, _layer in shim.wrappers(peft.utils.other.prepare_model_for_kbit_training)] == [NAME]
    assert peft.prepare_model_for_kbit_training is peft.utils.other.prepare_model_for_kbit_training
    assert peft.utils.prepare_model_for_kbit_training is peft.utils.other.prepare_model_for_kbit_training

    code = f"""
        import importlib
        import peft, peft.utils, peft.utils.other
        consumers = [peft, peft.utils]
        for name in ("trl.experimental.cpo.cpo_trainer", "trl.trainer.cpo_trainer"):  # trl binds it by name
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(module, "prepare_model_for_kbit_training"):
                consumers.append(module)
                break
        original = peft.utils.other.prepare_model_for_kbit_training
        assert all(module.prepare_model_for_kbit_training is original for module in consumers)

        import shim
        record = next(p for p in shim.status() if p.name == {NAME!r})
        assert record.state == "applied", record
        patched = peft.utils.other.prepare_model_for_kbit_training
        assert patched is not original and patched.__wrapped__ is original, "the target is wrapped"
        for module in consumers:
            assert module.prepare_model_for_kbit_training is patched, module.__name__

        shim.deactivate()
        assert all(module.prepare_model_for_kbit_training is original for module in consumers)
        print("ok", [module.__name__ for module in consumers])
    """
    out = run_python(code, env={"TRL_EXPERIMENTAL_SILENCE": "1"}, torch_first=True).stdout.strip()
    assert out.startswith("ok ['peft', 'peft.utils'"), out
    if importlib.util.find_spec("trl") is not None:
        assert "cpo_trainer" in out, out


def test_the_bug_probe_finds_the_bug_with_the_patch_off_only():

    with shim.disabled(NAME):
        assert bug_found(NAME) is True
    assert bug_found(NAME) is False


def test_the_shape_check_reads_peft_s_signature():
    import peft.utils.other

    from shim.patches.kbit_prepare_keeps_checkpointing import _check

    assert _check(peft.utils.other.prepare_model_for_kbit_training.__wrapped__) is None

    def changed(model, gradient_checkpointing_kwargs=None, use_gradient_checkpointing=True):
        return model

    assert "signature changed" in _check(changed)


# -- trl's own copy (trl.experimental.utils, called by its prepare_peft_model for QLoRA) --------------


def test_trls_own_copy_keeps_the_configuration_too(spy):
    """trl (0.28+) carries its own ``prepare_model_for_kbit_training`` with peft's ``None -> {}``;
    its ``prepare_peft_model`` calls it by that module-level name, which the patch wraps."""
    utils = pytest.importorskip("trl.experimental.utils")
    if not hasattr(utils, "prepare_model_for_kbit_training"):
        pytest.skip("version rule: trl has its own copy from 0.28")
    configured = {"use_reentrant": False, "preserve_rng_state": False}
    results = {}
    for switched in ("off", "on"):
        model = models.kbit_flagged_llama()
        configure(model, configured, 2 if supports("every_n_layers") else 1, False)
        before = describe(model)
        if switched == "off":
            with shim.disabled(NAME):
                quietly(utils.prepare_model_for_kbit_training, model)
        else:
            quietly(utils.prepare_model_for_kbit_training, model)
        results[switched] = (before, describe(model), train_step(model, spy))
    before, upstream, (upstream_kwargs, _warnings) = results["off"]
    assert upstream != before, "bug: trl's copy re-enables with {}"
    assert upstream_kwargs == {()}, "bug: torch's checkpoint gets none of the configured kwargs"
    before, fixed, (fixed_kwargs, warned) = results["on"]
    assert fixed == before
    assert fixed_kwargs == {tuple(sorted(configured.items()))}
    assert not any(TORCH_WARNING in message for message in warned)
    assert [name for name, _layer in shim.wrappers(utils.prepare_model_for_kbit_training)] == [NAME]
