"""The first-step audit (``shim.audit``): at a model's first optimizer step it names the trainable
parameters whose module ran in the training forward and got no gradient, and checkpointing asked for
that no layer ran; it names nothing where training is right, and leaves nothing behind after.

The family's reproducers run in fresh interpreters (what a user sees on stderr), each with its patch
switched off (``SHIM_DISABLE=<name>``: the audit names it, and the patch) and with the shim on
(nothing named). The public call and the hooks' lifetime are tested in process.
"""

import json
import sys
import types
import warnings

import pytest
import torch

import shim
from shim import audit
from shim.tools import bugreport
from tests.conftest import run_python

AUDIT = "first-step audit"


def audited(script: str, disable: str = "") -> tuple[str, list]:
    """``script`` (which trains) in a fresh interpreter: its stderr and the findings it printed last."""
    env = {"SHIM_DISABLE": disable} if disable else {}
    tail = "\nimport json as _j, shim.audit as _a\nprint('FOUND', _j.dumps([f.as_dict() for f in _a.found]))\n"
    done = run_python(script + tail, env=env, torch_first=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("FOUND "))
    return done.stderr, json.loads(line[len("FOUND ") :])


PREAMBLE = """
import warnings
import shim, torch
warnings.simplefilter("ignore", FutureWarning)
warnings.filterwarnings("ignore", "None of the inputs")
from tests.steps import enable_checkpointing
torch.manual_seed(0)
"""

LORA = (
    PREAMBLE
    + """
import peft
from tests.tinymodels import tiny_llama, lora_config
model = peft.get_peft_model(tiny_llama(4), lora_config(target_modules=["q_proj", "v_proj", "lm_head"]))
model.train()
enable_checkpointing(model, {"use_reentrant": True})
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
ids = torch.randint(1, 60, (2, 8))
embeds = model.get_input_embeddings()(ids).detach()  # merged ahead, as a multimodal model's: frozen
for _ in range(2):
    model(inputs_embeds=embeds, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""
)

KEYWORD = (
    PREAMBLE
    + """
from tests.tinymodels import tiny_llama


class Draft(torch.nn.Module):  # a draft model's stack: its decoder layers called with hidden_states= by keyword
    def __init__(self):
        super().__init__()
        self.llama = tiny_llama(3)

    def forward(self, ids):
        inner = self.llama.model
        hidden = inner.embed_tokens(ids)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        rotary = inner.rotary_emb(hidden, positions)
        for layer in inner.layers:
            out = layer(hidden_states=hidden, position_ids=positions, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.llama.lm_head(inner.norm(hidden)).float().logsumexp(-1).mean()


model = Draft()
model.train()
enable_checkpointing(model.llama, {"use_reentrant": True})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ids = torch.randint(1, 60, (2, 8))
for _ in range(2):
    model(ids).backward()
    optimizer.step()
    optimizer.zero_grad()
"""
)

REPLACED = (
    PREAMBLE
    + """
from tests.tinymodels import replaced_forward_llama
with replaced_forward_llama(3) as model:  # checkpointing on (non-reentrant), the layers' forward replaced
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(1, 60, (2, 8))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""
)


def test_lora_under_reentrant_checkpointing_frozen_inputs_is_named_with_its_patch_off():
    """The issue's "done when": one line names the adapter weights and why; the exit line says it too."""
    stderr, found = audited(LORA, disable="reentrant-frozen-input-grads")
    lines = [line for line in stderr.splitlines() if AUDIT in line]
    warning = next(line for line in lines if "ShimWarning" in line)
    assert "layers.{0..3}.*: 16 tensor(s)" in warning, warning
    assert "no input that requires grad" in warning
    assert "python -m shim explain reentrant-frozen-input-grads" in warning
    assert any(line.startswith("hf-train-shim first-step audit: PeftModel: 16") for line in lines), lines
    [finding] = found
    assert finding["kind"] == "no-gradient" and finding["causes"] == ["frozen-inputs"]
    assert all(".lora_" in name for name in finding["parameters"]) and len(finding["parameters"]) == 16
    assert finding["switched_off"] == ["reentrant-frozen-input-grads"]


def test_lora_under_reentrant_checkpointing_with_the_shim_on_names_nothing():
    stderr, found = audited(LORA)
    assert found == [] and AUDIT not in stderr, stderr


def test_keyword_inputs_are_named_with_reentrant_keyword_grads_off():
    stderr, found = audited(KEYWORD, disable="reentrant-keyword-grads")
    [finding] = found
    assert "keyword-inputs" in finding["causes"] and finding["switched_off"] == ["reentrant-keyword-grads"]
    layer_0 = [name for name in finding["watched"] if name.startswith("llama.model.layers.0.")]
    assert set(layer_0) <= set(finding["parameters"]) and layer_0, finding["parameters"]
    assert "python -m shim explain reentrant-keyword-grads" in stderr
    stderr, found = audited(KEYWORD)
    assert found == [] and AUDIT not in stderr, stderr


def test_checkpointing_that_did_not_run_is_named_with_replaced_forward_keeps_checkpointing_off():
    stderr, found = audited(REPLACED, disable="replaced-forward-keeps-checkpointing")
    [finding] = found
    assert finding["kind"] == "not-checkpointed" and len(finding["parameters"]) == 3
    assert "no layer ran checkpointed" in stderr and "replaced-forward-keeps-checkpointing" in stderr
    stderr, found = audited(REPLACED)
    assert found == [] and AUDIT not in stderr, stderr


TRAINER = (
    PREAMBLE
    + """
import tempfile, transformers
from tests.patches.checkpointing_cases import TrainerRows
from tests.tinymodels import replaced_forward_llama
with replaced_forward_llama(3) as model, tempfile.TemporaryDirectory() as folder:
    args = transformers.TrainingArguments(
        output_dir=folder, max_steps=2, per_device_train_batch_size=2, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=TrainerRows()).train()
    print(shim.in_effect(model))
"""
)


def test_the_trainer_is_audited_through_accelerate_and_in_effect_says_it():
    """The Trainer (accelerate's optimizer around the torch one) gives the same signal as a plain loop."""
    stderr, found = audited(TRAINER, disable="replaced-forward-keeps-checkpointing")
    [finding] = found
    assert finding["kind"] == "not-checkpointed" and finding["switched_off"] == ["replaced-forward-keeps-checkpointing"]


OWN_BUG = """
import shim, torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 2)
    def forward(self, x):
        h = self.body(x)
        return self.head(h), self.aux(h)  # the aux head runs, and its output is left out of the loss
net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(3, 4)
for _ in range(2):
    net(x)[0].sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print("VIEW", shim.in_effect(net).as_dict()["audit"])
"""


def test_a_users_own_head_left_out_of_the_loss_is_named_and_opted_out_like_a_patch():
    done = run_python(OWN_BUG, torch_first=True)
    assert "VIEW ['hf-train-shim first-step audit: 2 trainable tensor(s) of Net" in done.stdout, done.stdout
    stderr, found = audited(OWN_BUG)
    [finding] = found
    assert sorted(finding["parameters"]) == ["aux.bias", "aux.weight"] and finding["causes"] == ["unused"]
    assert finding["patches"] == [] and "the loss does not depend on their output" in stderr
    for disable in ("first-step-audit", "all", "FIRST_STEP_AUDIT"):
        stderr, found = audited(OWN_BUG, disable=disable)
        assert found == [] and AUDIT not in stderr, stderr
        assert "unknown patch" not in stderr, stderr


# -- in process ------------------------------------------------------------------------------------


class Routed(torch.nn.Module):
    """Two experts, one routed per call; a trunk; an ``extra`` module run only under no_grad."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(4, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.extra = torch.nn.Linear(4, 4)

    def forward(self, x, expert=0):
        with torch.no_grad():
            self.extra(x)  # a reference computation inside forward, under no_grad: never named
        return self.experts[expert](self.trunk(x))


def hooks_left(*modules) -> int:
    from torch.nn.modules import module

    own = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for root in modules for m in root.modules())
    return own + len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)


def test_modules_that_did_not_run_or_ran_under_no_grad_and_a_reference_model_are_not_named():
    torch.manual_seed(0)
    model, reference = Routed(), Routed()
    reference.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    before = list(audit.found)
    with warnings.catch_warnings():
        warnings.simplefilter("error", shim.ShimWarning)
        for expert in (0, 0, 1):  # gradient accumulation over two micro-batches, then a step
            with torch.no_grad():
                reference(x)
            model(x, expert).sum().backward()
            if expert == 0:
                continue
            optimizer.step()
    assert audit.found == before
    assert audit.findings_of(model) == ()
    assert shim.in_effect(model).audit == ("first-step audit: nothing named at its first step",)
    assert "first-step audit: not run on it yet" in str(shim.in_effect(reference))
    assert bugreport.first_step_audit().startswith("On: it names")
    model(x)  # the next step's first call takes the step hook off (torch runs them from the live dict)
    assert hooks_left(model) == 0, "the first step leaves no hook behind"
    assert optimizer._optimizer_step_pre_hooks == {}


def test_the_public_call_returns_findings_as_data_and_gives_the_model_back():
    torch.manual_seed(0)
    model = Routed()
    model.eval()
    model.trunk.weight.grad = torch.ones_like(model.trunk.weight)
    found = shim.audit_first_step(model, (torch.randn(2, 4),), loss=lambda out: out.sum())
    assert found == []
    assert not model.training and torch.equal(model.trunk.weight.grad, torch.ones_like(model.trunk.weight))
    assert hooks_left(model) == 0

    class Unused(Routed):
        def forward(self, x, expert=0):
            self.experts[1](x)  # runs, left out
            return super().forward(x, expert)

    [finding] = shim.audit_first_step(Unused(), {"x": torch.randn(2, 4)}, loss=lambda out: out.sum())
    assert finding.parameters == ("experts.1.weight", "experts.1.bias") or set(finding.parameters) == {
        "experts.1.weight",
        "experts.1.bias",
    }
    assert finding.causes == ("unused",) and finding.as_dict()["line"].startswith("hf-train-shim first-step audit")
    with pytest.raises(TypeError, match="no .loss"):
        shim.audit_first_step(Routed(), (torch.randn(2, 4),))


def test_grouping_names_numbered_modules_as_spans():
    names = [f"model.layers.{i}.mlp.down_proj.lora_A.weight" for i in range(32)]
    sizes = dict.fromkeys(names, 32 * 1024)
    assert (
        audit.grouped(names, sizes)
        == "model.layers.{0..31}.mlp.down_proj.lora_A.weight: 32 tensor(s), 1.0 M parameters"
    )
    assert audit.grouped(["a.1.w", "a.3.w"]) == "a.{1,3}.w"


def test_under_deepspeed_the_audit_says_once_that_it_does_not_run(monkeypatch):
    """ZeRO partitions the gradients (``p.grad`` stays ``None``): the audit says so and names nothing."""
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))  # as once it is imported
    forward = lambda self, x: self.module(x)  # noqa: E731
    deepspeed_engine = type(
        "DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine", "forward": forward}
    )
    engine = deepspeed_engine()
    engine.module = torch.nn.Linear(2, 2)
    assert (
        shim.audit_first_step(engine, (torch.randn(1, 2),), loss=lambda out: torch.zeros((), requires_grad=True)) == []
    )
    assert [note for note in audit.notes if "DeepSpeed" in note] == [
        f"hf-train-shim {audit.NAME}: not run under DeepSpeed ZeRO, whose gradients are partitioned"
    ]


def test_deactivate_puts_the_optimizers_init_back_and_activate_watches_again():
    """``shim.deactivate()`` removes every layer the shim installed: the audit's watch of optimizers
    too (torch's own ``Optimizer.__init__`` again, and an optimizer made then is not watched)."""
    upstream = torch.optim.Optimizer.__init__.__wrapped__
    try:
        shim.deactivate()
        assert torch.optim.Optimizer.__init__ is upstream
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        assert audit.findings_of(model) is None, "not watched while the shim is off"
    finally:
        shim.activate()
    assert torch.optim.Optimizer.__init__.__wrapped__ is upstream
