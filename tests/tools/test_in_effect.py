"""``shim.in_effect(model)``: is the fix in effect on my model? Run in fresh interpreters, as a user
runs a training script: the view says how the model checkpoints, which patches act on it and how,
and its adapters; it is a dict too, and reading it changes nothing."""

import json

import pytest

from tests.conftest import run_python

LLAMA = """
import json, warnings
warnings.simplefilter("ignore")
import shim
from tests.tinymodels import tiny_llama

model = tiny_llama(3)
model.train()
before = str(shim.in_effect(model))
model.gradient_checkpointing_enable({"use_reentrant": True})
model.gradient_checkpointing_disable()
held = shim.in_effect(model).as_dict()
model.gradient_checkpointing_enable()
flags = [layer.gradient_checkpointing for layer in model.model.layers]
functions = [layer._gradient_checkpointing_func for layer in model.model.layers]
view = shim.in_effect(model)
unchanged = flags == [layer.gradient_checkpointing for layer in model.model.layers] and all(
    f is layer._gradient_checkpointing_func for f, layer in zip(functions, model.model.layers))
with shim.disabled("reentrant-keyword-grads"):
    suspended = shim.in_effect(model).as_dict()["patches"]
print(json.dumps({"before": before, "held": held, "text": str(view), "view": view.as_dict(),
                  "unchanged": unchanged, "suspended": sorted(suspended)}))
"""


def test_a_reentrant_llama_shows_its_configuration_and_the_steps_on_its_calls():
    out = json.loads(run_python(LLAMA, torch_first=True).stdout.splitlines()[-1])
    assert "checkpointing off: model, model.layers.0-2 (4 module(s))" in out["before"]
    assert out["held"]["patches"]["checkpointing-restore"][0].startswith(
        "holds the configuration of the last disable ({'use_reentrant': True}, 4 module(s))"
    )
    view = out["view"]
    assert view["model"] == "LlamaForCausalLM"
    [group] = view["checkpointing"]
    assert group == {
        "modules": ["model", "model.layers.0", "model.layers.1", "model.layers.2"],
        "on": True,
        "function": "torch.utils.checkpoint.checkpoint",
        "kwargs": {"use_reentrant": True},
    }, "the configuration put back after the bare re-enable"
    for step in ("reentrant-keyword-grads", "reentrant-frozen-input-grads"):
        [said] = view["patches"][step]
        assert said.startswith("acts on the calls of 3 LlamaDecoderLayer layer(s), 3 checkpointing now: "), said
    assert view["patches"]["checkpoint-function-finds-layer"] == [], "torch's own function needs no layer"
    assert "through torch.utils.checkpoint.checkpoint {'use_reentrant': True}" in out["text"]
    assert "reentrant-keyword-grads: acts on the calls of 3 LlamaDecoderLayer layer(s)" in out["text"]
    assert out["unchanged"] is True
    assert "reentrant-keyword-grads" not in out["suspended"], "a patch switched off does not act"


TOWER = """
import json, warnings
warnings.simplefilter("ignore")
import shim
from tests.tinymodels import tiny_qwen2_vl, vision_tower

model, _inputs = tiny_qwen2_vl()
vision_tower(model).requires_grad_(False)
model.gradient_checkpointing_enable({"use_reentrant": False})
frozen = shim.in_effect(model).as_dict()["patches"]["frozen-tower-input-grads"]
vision_tower(model).requires_grad_(True)
trainable = shim.in_effect(model).as_dict()["patches"]["frozen-tower-input-grads"]
print(json.dumps({"frozen": frozen, "trainable": trainable}))
"""


def test_a_frozen_tower_is_shown_kept_out_of_backward_while_it_is_frozen():
    out = json.loads(run_python(TOWER, torch_first=True).stdout.splitlines()[-1])
    [frozen] = out["frozen"]
    assert frozen.startswith("model.visual (") and frozen.endswith("frozen now: kept out of backward")
    [trainable] = out["trainable"]
    assert trainable.endswith("trainable now, so in backward")


ADAPTERS = """
import json, warnings
warnings.simplefilter("ignore")
import shim
from peft import LoraConfig, get_peft_model
from tests.tinymodels import tiny_llama

model = get_peft_model(tiny_llama(2), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj", "v_proj"], inference_mode=True))
print(json.dumps(shim.in_effect(model).as_dict()["adapters"]))
"""


def test_a_peft_model_shows_its_adapters_and_which_train():
    out = json.loads(run_python(ADAPTERS, torch_first=True).stdout.splitlines()[-1])
    assert out == {
        "default": {"active": True, "trainable": 8, "parameters": 8},
        "other": {"active": False, "trainable": 0, "parameters": 8},
    }


def test_with_the_shim_switched_off_no_patch_acts():
    code = LLAMA.replace('with shim.disabled("reentrant-keyword-grads")', "if True")
    out = json.loads(run_python(code, env={"SHIM_DISABLE": "all"}, torch_first=True).stdout.splitlines()[-1])
    assert out["view"]["patches"] == {}
    assert out["view"]["checkpointing"][0]["kwargs"] == {"use_reentrant": False}, "upstream's bare re-enable"


NOT_A_MODEL = """
import json
import shim
said = []
for given in (None, "model", shim):
    try:
        shim.in_effect(given)
    except TypeError as error:
        said.append(str(error))
print(json.dumps(said))
"""


@pytest.mark.parametrize("env", [None, {"SHIM_DISABLE": "all"}], ids=["on", "off"])
def test_anything_but_a_model_is_refused_with_a_type_error_that_says_what_to_pass(env):
    # None used to end in AttributeError: 'NoneType' object has no attribute 'named_modules'.
    said = json.loads(run_python(NOT_A_MODEL, env=env).stdout)
    fix = ": pass the model itself, e.g. shim.in_effect(trainer.model)"
    assert said == [
        f"shim.in_effect() takes a model (a torch.nn.Module, peft's wrapper included), not {got}{fix}"
        for got in ("None", "a str", "a module")
    ]
