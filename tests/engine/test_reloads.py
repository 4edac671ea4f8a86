"""A reload of a target module, as IPython's autoreload and a notebook do it: the reloaded module gets
the shim's layer again with every part that was in it, the classes of models built before it keep
theirs, and a status never says "failed" for the shim's own target reloaded. Each case runs in a fresh
interpreter with the shim on, off (``SHIM_DISABLE=all``) and without it, and trains a tiny 2-layer
Llama whose layers get their hidden states by keyword, under reentrant checkpointing: with the fix,
its gradients equal those of a run without checkpointing; without it, they do not. trl's, peft's and
accelerate's target modules come back whole too."""

import json

import pytest
import transformers.modeling_layers  # noqa: F401  (the parts this process has, to compare)

import shim
from tests.conftest import run_python

SLOT = "transformers.modeling_layers:GradientCheckpointingLayer._gradient_checkpointing_func"
SETSTATE = "transformers.modeling_layers:GradientCheckpointingLayer.__setstate__"

RELOADS = """
import importlib, json, sys, warnings
import torch
mode = {mode!r}
if mode != "without":
    import shim
import transformers.modeling_utils, transformers.modeling_layers
from transformers.models.llama import configuration_llama, modeling_llama
from tests.steps import enable_checkpointing, keyword_driven_grads, wrong_grads
warnings.simplefilter("ignore")  # torch's "none of the inputs require grad" is the bug speaking
config = configuration_llama.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
SLOT, SETSTATE, LAYERS = {slot!r}, {setstate!r}, "transformers.modeling_layers"

def build():  # from the model's module as it is now (reloaded or not)
    torch.manual_seed(0)
    return sys.modules["transformers.models.llama.modeling_llama"].LlamaForCausalLM(config).train()

def checkpointing_keeps_grads(model):  # each decoder layer gets its hidden states by keyword
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = keyword_driven_grads(model, ids)
    enable_checkpointing(model, {{"use_reentrant": True}})
    return not wrong_grads(reference, keyword_driven_grads(model, ids))

def parts(spec):
    return [name for name, _layer in shim.wrappers(spec)] if mode != "without" else []

built_before = build()
parts_before = {{spec: parts(spec) for spec in (SLOT, SETSTATE)}}
for name in {order!r}:
    importlib.reload(sys.modules[name])
out = {{
    "built before": checkpointing_keeps_grads(built_before),
    "built after": checkpointing_keeps_grads(build()),
    "parts kept": {{spec: parts(spec) == before for spec, before in parts_before.items()}},
}}
if mode != "without":
    out["states"] = {{s.name: s.state for s in shim.status() if LAYERS in shim.registry.declared(s.name).modules}}
    out["parts"] = parts_before[SLOT]
    reasons = [s.reason.split("; ") for s in shim.status()]
    out["notes said twice"] = [notes for notes in reasons if len(set(notes)) < len(notes)]
print(json.dumps(out))
"""

LAYERS, UTILS = "transformers.modeling_layers", "transformers.modeling_utils"
LLAMA = "transformers.models.llama.modeling_llama"

#: What is reloaded, in order: the checkpointing path's module alone, then with the model's module
#: after it or before it, everything as autoreload goes (in sys.modules' order: modeling_utils, the
#: layers, the model), twice in a row, and the models' base module alone.
ORDERS = [(LAYERS,), (LAYERS, LLAMA), (LLAMA, LAYERS), (UTILS, LAYERS, LLAMA), (LAYERS, LLAMA, LAYERS, LLAMA), (UTILS,)]


def reloaded(order: tuple[str, ...], mode: str) -> dict:
    code = RELOADS.format(mode=mode, order=order, slot=SLOT, setstate=SETSTATE)
    env = {"SHIM_DISABLE": "all"} if mode == "off" else None
    result = run_python(code, env=env, timeout=240, torch_first=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(m.rpartition(".")[2] for m in o) for o in ORDERS])
def test_a_reload_keeps_every_part_of_the_checkpointing_fixes(order):
    out = reloaded(order, "on")
    # As in this process, where transformers was imported once: the same parts, the same states.
    assert out["parts"] == [name for name, _layer in shim.wrappers(SLOT)]
    in_this_process = {s.name: s.state for s in shim.status() if s.name in out["states"]}
    assert out["states"] == in_this_process, "never failed for the shim's own target"
    assert "applied" in out["states"].values()
    assert out["parts kept"] == {SLOT: True, SETSTATE: True}
    assert out["notes said twice"] == []
    assert (out["built before"], out["built after"]) == (True, True), "gradients equal to no checkpointing"


@pytest.mark.parametrize("mode", ["off", "without"])
def test_the_reload_test_sees_the_bug_with_the_shim_off_and_without_it(mode):
    out = reloaded((UTILS, LAYERS, LLAMA), mode)
    assert (out["built before"], out["built after"]) == (False, False)
    if mode == "off":
        assert set(out["states"].values()) == {"disabled"}


FROZEN_TOWER = """
import importlib, json, sys
import torch
import shim
from tests.steps import enable_checkpointing
from tests.tinymodels import tiny_qwen2_vl, vision_tower


def bug_shows():  # whether enabling checkpointing makes a frozen tower's embeddings' output require grad
    model, inputs = tiny_qwen2_vl()
    tower = vision_tower(model)
    tower.requires_grad_(False)
    enable_checkpointing(model, {"use_reentrant": False})
    with torch.enable_grad():
        return bool(tower.patch_embed(inputs["pixel_values"]).requires_grad)


before = bug_shows()  # the fix has acted once: the VLM's modules are imported
importlib.reload(sys.modules["transformers.modeling_utils"])
for name in [name for name in list(sys.modules) if name.startswith("transformers.models.qwen2_vl.modeling")]:
    importlib.reload(sys.modules[name])
print(json.dumps({"bug before the reload": before, "bug after": bug_shows()}))
"""


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_frozen_tower_stays_out_of_backward_in_a_model_built_after_a_reload(mode):
    # The patch had kept the PreTrainedModel class it met first, which a model built from reloaded
    # modules is no instance of: its frozen vision tower's output required grad again.
    env = {"SHIM_DISABLE": "all"} if mode == "off" else None
    out = json.loads(run_python(FROZEN_TOWER, env=env, timeout=240, torch_first=True).stdout.strip().splitlines()[-1])
    applies = shim.status()[shim.registry.names.index("frozen-tower-input-grads")].state == "applied"
    fixed = mode == "on" and applies
    assert out == {"bug before the reload": not fixed, "bug after": not fixed}


OTHER_LIBRARIES = """
import importlib, json, sys
import torch
import shim
from shim.tools import doctor
from shim.tools.targets import import_targets, quiet_transformers
quiet_transformers()
names = list(shim.registry.names)
import_targets(shim.registry, names)
modules = sorted({module for name in names for module in shim.registry.declared(name).modules
                  if module in sys.modules and not module.startswith("transformers")})


def seen():
    targets = [t for name in names for t in shim.registry.patch(name).targets if t.module in modules]
    return {"states": {s.name: [str(s.state), s.reason] for s in shim.status()},
            "parts": {t.spec: [name for name, _layer in shim.wrappers(t.spec)] for t in targets}}


def bugs():  # each probe of a library outside transformers, with its patch off and on
    found = {}
    for name in names:
        if shim.status()[names.index(name)].state != "applied":
            continue
        with shim.disabled(name):
            off = {a.library: a.present for a in doctor.ask(shim.registry.patch(name)) if a.library != "transformers"}
        on = {a.library: a.present for a in doctor.ask(shim.registry.patch(name)) if a.library != "transformers"}
        found |= {f"{name} ({library})": [off[library], on[library]] for library in off}
    return found


before, bugs_before = seen(), bugs()
for module in modules:
    importlib.reload(sys.modules[module])
print(json.dumps({"modules": modules, "before": before, "after": seen(), "bugs before": bugs_before,
                  "bugs after": bugs()}))
"""


def test_a_reload_of_trls_peft_s_or_accelerates_target_module_gets_the_layer_again():
    """trl's, peft's and accelerate's target modules reloaded (trl's functions are contextlib's
    generator-context wrappers around trl's code): every patch keeps its state and its parts, none
    "failed", and each fix acts in the reloaded module (its probe finds the bug with the patch off,
    none with it on). peft-adapter-trainability is forced, so that peft's classes hold its parts."""
    env = {"SHIM_FORCE": "peft-adapter-trainability"}
    out = json.loads(
        run_python(OTHER_LIBRARIES, env=env, timeout=240, torch_first=True).stdout.strip().splitlines()[-1]
    )
    assert {module.partition(".")[0] for module in out["modules"]} == {"trl", "peft", "accelerate"}
    assert out["after"] == out["before"]
    with_parts = {spec for spec, parts in out["after"]["parts"].items() if parts}
    assert with_parts >= {
        "trl.models.utils:disable_gradient_checkpointing", "trl.models.utils:_unwrap_model_for_generation",
        "peft.tuners.tuners_utils:BaseTuner.inject_adapter", "peft.peft_model:PeftModel.load_adapter",
        "peft.utils.other:prepare_model_for_kbit_training", "accelerate.utils.fsdp_utils:fsdp2_apply_ac",
    }, out["after"]["parts"]  # fmt: skip
    # peft 0.21 carries that fix: a reload of peft.tuners.tuners_utils alone, without the shim, loses it
    # (peft's tuners keep the old BaseTuner), with the forced backport as without it.
    forced = "peft-adapter-trainability (peft)"
    assert out["bugs before"].pop(forced) == [False, False]
    out["bugs after"].pop(forced)
    assert out["bugs after"] == out["bugs before"]
    assert {"checkpointing-call-signature (trl)", "trl-restore-on-error (trl)", "fsdp2-checkpoint-rng-state (accelerate)",
            "kbit-prepare-keeps-checkpointing (peft)"} <= set(out["bugs after"])  # fmt: skip
    assert all(found == [True, False] for found in out["bugs after"].values()), out["bugs after"]
