"""liger-kernel, for real (issue 24): ``apply_liger_kernel_to_llama`` touches none of the shim's targets.

liger-kernel's ``liger_kernel.transformers`` imports triton at once, and triton is ~1 GB installed, so
this runs in an environment of its own: ``bash scripts/e2e.sh`` builds ``.venvs/e2e-liger``
(``constraints/e2e-liger.txt``: the default stack with liger-kernel and triton) and runs this module
there. On CPU it imports and patches; a kernel launch would fail ("0 active drivers"), so no model is
run through it. What it rebinds and assigns is read from the objects, before and after.
"""

import importlib.util
import json

import pytest

from tests.conftest import run_python

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None,
        reason="needs liger-kernel and triton: bash scripts/e2e.sh runs it in .venvs/e2e-liger",
    ),
]

LIGER = """
import importlib, importlib.util, json, pkgutil
import shim, shim.patches
import transformers.models.llama.modeling_llama as llama
from liger_kernel.transformers import apply_liger_kernel_to_llama
from tests.tinymodels import tiny_llama

def resolve(spec):
    module, qualname = spec.split(":")
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)

specs = {"torch.utils.checkpoint:checkpoint", "torch.utils.checkpoint:CheckpointFunction",
         "transformers.modeling_utils:checkpoint", "trl.models.utils:disable_gradient_checkpointing",
         "transformers.models.llama.modeling_llama:LlamaDecoderLayer.forward"}
for info in pkgutil.iter_modules(shim.patches.__path__):
    if info.name.startswith("_"):
        continue
    patch = getattr(importlib.import_module("shim.patches." + info.name), "PATCH", None)
    specs |= {target.spec for target in getattr(patch, "targets", ())}
specs = {spec for spec in specs if importlib.util.find_spec(spec.split(".")[0].split(":")[0])}  # not DeepSpeed's, Ray's
targets = {spec: resolve(spec) for spec in specs}
names = dict(vars(llama))
classes = {name: dict(vars(value)) for name, value in names.items() if isinstance(value, type)}
model = tiny_llama(2)
apply_liger_kernel_to_llama()
apply_liger_kernel_to_llama(model=model)
print(json.dumps({
    "named": [(s.name, o["relation"]) for s in shim.status() for o in s.others],
    "failed": [s.name for s in shim.status() if s.state == "failed"],
    "targets": sorted(specs),
    "changed_targets": sorted(spec for spec, held in targets.items() if resolve(spec) is not held),
    "rebound_names": sorted(name for name, value in vars(llama).items() if names.get(name) is not value),
    "class_attributes": sorted(
        f"{name}.{attr}" for name, held in classes.items() for attr, value in vars(names[name]).items()
        if held.get(attr) is not value and not attr.startswith("_")
    ),
    "instance_forwards": sorted(
        name for name, module in model.named_modules() if "forward" in vars(module)
    ),
}))
"""


def test_liger_kernel_llama_touches_none_of_the_shims_targets():
    report = json.loads(run_python(LIGER).stdout.strip().splitlines()[-1])
    assert report["changed_targets"] == [] and len(report["targets"]) > 20
    assert report["named"] == [] and report["failed"] == []  # nothing to name, no patch fails beside it
    assert report["rebound_names"] == ["LlamaMLP", "LlamaRMSNorm", "apply_rotary_pos_emb"]
    assert report["class_attributes"] == ["LlamaForCausalLM.forward"]
    forwards = report["instance_forwards"]  # model= binds forward on instances: the model, norms, MLPs
    assert "" in forwards and all(name.endswith(("norm", "layernorm", "mlp")) for name in forwards if name)
