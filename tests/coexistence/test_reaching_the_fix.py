"""The status says "failed" only where a call of the target does not pass through the fix. Another
patcher's replacement of a checkpointing enable (unsloth's way: a plain function on the class) that
keeps the shim's layer and calls it, through a closure, a keyword default, a module global, a class
attribute or a ``functools.partial``, still runs ``checkpointing-restore``: a disable/enable cycle,
called through the replacement, keeps the configuration, and the status says the patcher sits above
the fix. One that calls upstream's own function instead bypasses it: the cycle loses the
configuration, and the status says "failed". Each mode in a fresh interpreter: the shim on, off
(``SHIM_DISABLE=all``), and without it."""

import json

import pytest
import transformers.modeling_utils  # noqa: F401  (this process's status says whether the patch applies)

import shim
from tests.conftest import run_python

REPLACEMENTS = """
import functools, json, sys, warnings
import torch
warnings.simplefilter("ignore", FutureWarning)
if {mode!r} != "without":
    import shim
from transformers import PreTrainedModel
from transformers.models.llama import configuration_llama, modeling_llama

NAME = "_activation_checkpointing_enable" if hasattr(PreTrainedModel, "activation_checkpointing_enable") else "gradient_checkpointing_enable"
ENABLE = "activation_checkpointing_enable" if hasattr(PreTrainedModel, "activation_checkpointing_enable") else "gradient_checkpointing_enable"
DISABLE = ENABLE.replace("enable", "disable")
KWARGS = ENABLE.replace("enable", "kwargs")
held = PreTrainedModel.__dict__[NAME]  # the shim's layer where the shim is on
orig_set = getattr(PreTrainedModel, NAME)  # what a patcher takes: the same object

def through_a_closure(original):
    def fast_set(self, *args, **kwargs):
        return original(self, *args, **kwargs)
    return fast_set

def fast_set_default(self, *args, _original=orig_set, **kwargs):
    return _original(self, *args, **kwargs)

def fast_set_global(self, *args, **kwargs):  # unsloth's shape
    return orig_set(self, *args, **kwargs)

class Patcher:
    original = orig_set

def fast_set_class(self, *args, **kwargs):
    return Patcher.original(self, *args, **kwargs)

call_original = functools.partial(orig_set)

def fast_set_partial(self, *args, **kwargs):
    return call_original(self, *args, **kwargs)

upstream_set = getattr(held, "__wrapped__", held)  # upstream's own function, past the shim's layer

def fast_set_upstream(self, *args, **kwargs):
    return upstream_set(self, *args, **kwargs)

REPLACEMENTS = {{
    "closure": through_a_closure(orig_set),
    "default": fast_set_default,
    "module global": fast_set_global,
    "class attribute": fast_set_class,
    "functools.partial": fast_set_partial,
    "upstream's own function": fast_set_upstream,
}}
config = configuration_llama.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)

def state(model):
    return [(layer.gradient_checkpointing, getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", None))
            for layer in model.model.layers]

out = {{}}
for kind, replacement in REPLACEMENTS.items():
    setattr(PreTrainedModel, NAME, replacement)
    model = modeling_llama.LlamaForCausalLM(config)
    getattr(model, ENABLE)(**{{KWARGS: {{"use_reentrant": True, "preserve_rng_state": False}}}})
    before = state(model)
    getattr(model, DISABLE)()  # trl's cycle around generation, through the replacement
    getattr(model, ENABLE)()
    found = {{"restored": state(model) == before}}
    if {mode!r} == "on":
        record = {{s.name: s for s in shim.status()}}["checkpointing-restore"]
        found["state"] = str(record.state)
        found["relations"] = sorted({{o["relation"] for o in record.others if o["target"].endswith(NAME)}})
    out[kind] = found
    setattr(PreTrainedModel, NAME, held)
print(json.dumps(out))
"""

REACHING = ["closure", "default", "module global", "class attribute", "functools.partial"]


def replaced(mode: str) -> dict:
    env = {"SHIM_DISABLE": "all"} if mode == "off" else None
    done = run_python(REPLACEMENTS.format(mode=mode), env=env, timeout=240, torch_first=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_replacement_that_keeps_the_shims_layer_runs_the_fix_and_the_status_says_so():
    assert {s.name: s.state for s in shim.status()}["checkpointing-restore"] == "applied"
    out = replaced("on")
    for kind in REACHING:
        assert out[kind] == {"restored": True, "state": "applied", "relations": ["above"]}, kind
    assert out["upstream's own function"] == {"restored": False, "state": "failed", "relations": ["bypassed"]}


@pytest.mark.parametrize("mode", ["off", "without"])
def test_the_cycle_loses_the_configuration_with_the_shim_off_or_without_it(mode):
    assert replaced(mode) == dict.fromkeys([*REACHING, "upstream's own function"], {"restored": False})
