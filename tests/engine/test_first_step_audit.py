"""The first-step audit (``shim.audit``): at an optimizer's first step it warns where gradients were cut
inside the model's path and where checkpointing asked for did not run, each with its cause; it names
a dead-end branch (a pooler, a head the loss leaves out) as data only; it says nothing in a healthy
run, never raises into the step, and leaves nothing behind.

The family's reproducers run in fresh interpreters (what a user sees on stderr), each with its patch
switched off (``SHIM_DISABLE=<name>``: the audit names it, and the patch) and with the shim on
(nothing named); so does the corpus of healthy runs, each with the shim on and off, warnings made
errors in its training loop. The public call and the hooks' lifetime are tested in process.
"""

import copy
import gc
import json
import logging
import pickle
import sys
import types
import warnings
import weakref

import pytest
import torch

import shim
from shim import audit
from shim.tools import bugreport
from tests.conftest import run_python

AUDIT = "first-step audit"
GLOBAL_HOOKS = "global hooks on modules"  # torch's warning at a compiled module's call


def audited(script: str, disable: str = "", env: dict | None = None) -> tuple[str, list]:
    """``script`` (which trains) in a fresh interpreter: its stderr and the findings it printed last."""
    env = {**({"SHIM_DISABLE": disable} if disable else {}), **(env or {})}
    tail = "\nimport json as _j, shim.audit as _a\nprint('FOUND', _j.dumps([f.as_dict() for f in _a.found]))\n"
    done = run_python(script + tail, env=env, torch_first=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("FOUND "))
    return done.stderr, json.loads(line[len("FOUND ") :])


PREAMBLE = """
import warnings
import shim, torch
warnings.simplefilter("ignore", FutureWarning)
warnings.filterwarnings("ignore", "None of the inputs")
from tests.steps import enable_checkpointing, keyword_loss
from tests.tinymodels import tiny_llama
torch.manual_seed(0)
"""

LORA = (
    PREAMBLE
    + """
import peft
from tests.tinymodels import lora_config
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
class Draft(torch.nn.Module):  # a draft model's stack: its decoder layers called with hidden_states= by keyword
    def __init__(self):
        super().__init__()
        self.llama = tiny_llama(3)

    def forward(self, ids):
        return keyword_loss(self.llama, ids)


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

# No module call around the layers: a training function calls the embeddings, each layer (with
# hidden_states= by keyword) and the head itself; the optimizer is made over the whole model.
TRAINING_FUNCTION = (
    PREAMBLE
    + """
model = tiny_llama(2)
model.train()
enable_checkpointing(model, {"use_reentrant": True})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(ids):
    keyword_loss(model, ids).backward()
    optimizer.step()
    optimizer.zero_grad()


for _ in range(2):
    train_step(torch.randint(1, 60, (2, 8)))
"""
)

# Two optimizers on one model (a Muon-style split: the layers' matrices in one, the rest in the
# other), the layers called with hidden_states= by keyword: both lose gradients.
SECOND_OPTIMIZER = (
    PREAMBLE
    + """
model = tiny_llama(2)
model.train()
enable_checkpointing(model, {"use_reentrant": True})
inner = model.model
matrices = [p for p in inner.layers.parameters() if p.ndim == 2]
others = [p for p in model.parameters() if not any(p is q for q in matrices)]
optimizers = [torch.optim.SGD(matrices, lr=0.1), torch.optim.AdamW(others, lr=1e-3)]
for _ in range(2):
    keyword_loss(model, torch.randint(1, 60, (2, 8))).backward()
    for optimizer in optimizers:
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


def warned(stderr: str) -> list:
    return [line for line in stderr.splitlines() if "ShimWarning" in line and AUDIT in line]


def test_lora_under_reentrant_checkpointing_frozen_inputs_is_named_with_its_patch_off():
    """One line names the adapter weights and why; the exit line says it too."""
    stderr, found = audited(LORA, disable="reentrant-frozen-input-grads")
    [warning] = warned(stderr)
    assert "layers.{0..3}.*: 16 tensor(s)" in warning, warning
    assert "no input that requires grad" in warning
    assert "python -m shim explain reentrant-frozen-input-grads" in warning
    assert any(line.startswith("hf-train-shim first-step audit: PeftModel: 16") for line in stderr.splitlines())
    [finding] = found
    assert finding["kind"] == "no-gradient" and finding["cause"] == "frozen-inputs" and finding["warns"]
    assert all(".lora_" in name for name in finding["parameters"]) and len(finding["parameters"]) == 16
    assert finding["switched_off"] == ["reentrant-frozen-input-grads"]


def test_lora_under_reentrant_checkpointing_with_the_shim_on_names_nothing():
    stderr, found = audited(LORA)
    assert found == [] and AUDIT not in stderr, stderr


def test_keyword_inputs_are_named_with_reentrant_keyword_grads_off_the_layers_before_them_with_them():
    """The embeddings lose their gradient because the first layer's reentrant checkpoint cut the
    graph: they are put down to that layer's cause, in the same line, not to a cut of their own."""
    stderr, found = audited(KEYWORD, disable="reentrant-keyword-grads")
    [finding] = found
    assert finding["cause"] == "keyword-inputs" and finding["switched_off"] == ["reentrant-keyword-grads"]
    layer_0 = [name for name in finding["watched"] if name.startswith("llama.model.layers.0.")]
    assert set(layer_0) <= set(finding["parameters"]) and layer_0, finding["parameters"]
    assert "llama.model.embed_tokens.weight" in finding["parameters"]
    assert "python -m shim explain reentrant-keyword-grads" in stderr
    stderr, found = audited(KEYWORD)
    assert found == [] and AUDIT not in stderr, stderr


def test_layers_called_from_a_training_function_are_each_watched_and_named_by_their_place():
    """No module call holds the layers: each module the loop calls itself is found at its call, and
    named by its class and its place among those of its class."""
    stderr, found = audited(TRAINING_FUNCTION, disable="reentrant-keyword-grads")
    [finding] = found
    assert finding["model"] == "Embedding, LlamaDecoderLayer" and finding["cause"] == "keyword-inputs", finding
    assert {"Embedding.weight", "LlamaDecoderLayer.0.self_attn.q_proj.weight"} <= set(finding["parameters"])
    assert "LlamaDecoderLayer.0.*: 9 tensor(s)" in finding["line"] and len(warned(stderr)) == 1, stderr
    stderr, found = audited(TRAINING_FUNCTION)
    assert found == [] and AUDIT not in stderr, stderr


def test_a_second_optimizer_on_the_same_model_is_audited_at_its_own_first_step():
    stderr, found = audited(SECOND_OPTIMIZER, disable="reentrant-keyword-grads")
    assert len(found) == 2 and all(f["cause"] == "keyword-inputs" for f in found), found
    matrices, others = (set(f["parameters"]) for f in found)
    assert "LlamaDecoderLayer.0.self_attn.q_proj.weight" in matrices
    assert {"Embedding.weight", "LlamaDecoderLayer.0.input_layernorm.weight"} <= others
    assert len(warned(stderr)) == 2, stderr
    stderr, found = audited(SECOND_OPTIMIZER)
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
    """The Trainer (its optimizer made in ``create_optimizer``, accelerate's around it) gives the same
    signal as a plain loop."""
    stderr, found = audited(TRAINER, disable="replaced-forward-keeps-checkpointing")
    [finding] = found
    assert finding["kind"] == "not-checkpointed" and finding["switched_off"] == ["replaced-forward-keeps-checkpointing"]


# -- the healthy corpus: nothing warned, nothing added to what torch says, warnings made errors --------

HEALTHY = {
    "BertModel with its pooler, mean pooling and an in-batch contrastive loss": """
import transformers
config = transformers.BertConfig(
    vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
)
model = transformers.BertModel(config)  # as AutoModel gives it: the pooler included, unused here
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(1, 64, (4, 8))
mask = torch.ones_like(ids)
warnings.simplefilter("error")  # a test suite's filterwarnings = error
for _ in range(2):
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    a, b = (torch.nn.functional.normalize(half, dim=-1) for half in (pooled[:2], pooled[2:]))
    torch.nn.functional.cross_entropy(a @ b.T / 0.05, torch.arange(2)).backward()
    optimizer.step()
    optimizer.zero_grad()
""",
    "a first step skipped by GradScaler, zero_grad, then another expert": """
class Experts(torch.nn.Module):  # one module per expert, one routed per batch
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(4, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x, expert):
        return self.experts[expert](self.trunk(x))


model = Experts()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
x = torch.randn(8, 4)
warnings.simplefilter("error")
for expert, size in ((0, 1e30), (1, 1.0)):  # the first batch overflows: its step is skipped
    scaler.scale(model(x * size, expert).pow(2).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
assert scaler.get_scale() == 512.0, "one step skipped, one taken"
""",
    "LBFGS with its closure, after a forward without backward": """
model = tiny_llama(2)
model.train()
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
ids = torch.randint(1, 60, (2, 8))
warnings.simplefilter("error")
model(input_ids=ids, labels=ids)


def closure():
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


for _ in range(2):
    optimizer.step(closure)
""",
    "gradient accumulation": """
model = tiny_llama(2)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
warnings.simplefilter("error")
for _ in range(2):
    for _ in range(3):
        ids = torch.randint(1, 60, (2, 8))
        (model(input_ids=ids, labels=ids).loss / 3).backward()
    optimizer.step()
    optimizer.zero_grad()
""",
    "tied weights": """
model = tiny_llama(2, tie_word_embeddings=True)
assert model.lm_head.weight is model.model.embed_tokens.weight
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
warnings.simplefilter("error")
for _ in range(2):
    ids = torch.randint(1, 60, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
""",
    "two optimizers on one model": """
model = tiny_llama(2)
model.train()
matrix = lambda name, p: p.ndim == 2 and "embed" not in name and "lm_head" not in name
optimizers = [
    torch.optim.SGD([p for n, p in model.named_parameters() if matrix(n, p)], lr=0.1, momentum=0.9),
    torch.optim.AdamW([p for n, p in model.named_parameters() if not matrix(n, p)], lr=1e-3),
]
warnings.simplefilter("error")
for _ in range(2):
    ids = torch.randint(1, 60, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
""",
    "an optimizer per parameter, stepped in backward": """
model = tiny_llama(2)
model.train()
optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}


def step_in_backward(parameter):
    optimizers[parameter].step()
    optimizers[parameter].zero_grad()


for p in model.parameters():
    p.register_post_accumulate_grad_hook(step_in_backward)
warnings.simplefilter("error")
for _ in range(2):
    ids = torch.randint(1, 60, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
""",
    "a frozen reference model": """
import copy
model = tiny_llama(2)
reference = copy.deepcopy(model).eval().requires_grad_(False)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
warnings.simplefilter("error")
for _ in range(2):
    ids = torch.randint(1, 60, (2, 8))
    with torch.no_grad():
        reference_logits = reference(input_ids=ids).logits
    logits = model(input_ids=ids).logits
    (logits.log_softmax(-1) - reference_logits.log_softmax(-1)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
""",
    "torch.compile(model) after the optimizer is made": """
model = tiny_llama(2)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model, backend="eager")  # the Trainer's and trl's --torch_compile order
warnings.simplefilter("error")  # torch's warning on global module hooks would raise here
for _ in range(2):
    ids = torch.randint(1, 60, (2, 8))
    compiled(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
""",
}


@pytest.mark.parametrize("case", list(HEALTHY))
def test_a_healthy_run_gets_no_warning_and_nothing_added_to_what_torch_says(case):
    """With the shim off the run works (the test tests something), with it on too: no audit warning,
    no torch warning, nothing raised under warnings made errors; only data-only findings."""
    script = PREAMBLE + HEALTHY[case]
    off, found_off = audited(script, disable="all")
    assert found_off == [] and AUDIT not in off and GLOBAL_HOOKS not in off, off
    stderr, found = audited(script)
    assert AUDIT not in stderr and GLOBAL_HOOKS not in stderr, stderr
    assert not [f for f in found if f["warns"]], found


def test_a_pooler_left_out_of_the_loss_is_data_said_at_info_and_in_effect_never_a_warning():
    case = "BertModel with its pooler, mean pooling and an in-batch contrastive loss"
    script = PREAMBLE + HEALTHY[case] + "\nprint('VIEW', shim.in_effect(model).as_dict()['audit'])\n"
    stderr, found = audited(script, env={"SHIM_LOG_LEVEL": "INFO"})
    [finding] = found
    assert finding["cause"] == "dead-end" and not finding["warns"]
    assert sorted(finding["parameters"]) == ["pooler.dense.bias", "pooler.dense.weight"]
    assert "shim INFO: hf-train-shim first-step audit: 2 trainable tensor(s) of BertModel" in stderr, stderr
    assert "ShimWarning" not in stderr and "(the warning says which and why)" not in stderr
    done = run_python(script, torch_first=True)
    assert "VIEW ['hf-train-shim first-step audit: 2 trainable tensor(s) of BertModel" in done.stdout, done.stdout
    assert AUDIT not in done.stderr, done.stderr


OWN_BUG = """
import shim, torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 2)
    def forward(self, x):
        h = self.body(x)
        return self.head(h.detach() if CUT else h), self.aux(h)  # aux runs, its output left out of the loss
CUT = {cut}
net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(3, 4)
for _ in range(2):
    net(x)[0].sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_gradient_cut_inside_the_users_own_model_is_warned_and_opted_out_like_a_patch():
    """The body runs before the head, which gets its gradient; a detach between them leaves the body
    none: a cut, warned. The aux head after them is a dead end: data."""
    stderr, found = audited(OWN_BUG.format(cut=True))
    cut, dead_end = sorted(found, key=lambda f: f["cause"])
    assert cut["cause"] == "cut" and sorted(cut["parameters"]) == ["body.bias", "body.weight"] and cut["warns"]
    assert dead_end["cause"] == "dead-end" and sorted(dead_end["parameters"]) == ["aux.bias", "aux.weight"]
    [warning] = warned(stderr)
    assert "body.bias" in warning and "a detach" in warning and "aux" not in warning
    for disable in ("first-step-audit", "all", "FIRST_STEP_AUDIT"):
        stderr, found = audited(OWN_BUG.format(cut=True), disable=disable)
        assert found == [] and AUDIT not in stderr, stderr
        assert "unknown patch" not in stderr, stderr
    stderr, found = audited(OWN_BUG.format(cut=False))
    assert [f["cause"] for f in found] == ["dead-end"] and AUDIT not in stderr, stderr


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


def hooks_on(*modules) -> int:
    """The hooks on ``modules``, their submodules and parameters."""
    own = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for root in modules for m in root.modules())
    return own + sum(len(p._post_accumulate_grad_hooks or {}) for root in modules for p in root.parameters())


def hooks_left(*modules) -> int:
    """:func:`hooks_on`, and torch's global module hooks."""
    from torch.nn.modules import module

    return hooks_on(*modules) + len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)


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
            assert hooks_on(model) > 0 and hooks_on(reference) == 0, "the model is watched, not the reference"
            if expert == 0:
                continue
            optimizer.step()
    assert audit.found == before
    assert audit.findings_of(model) == ()
    assert shim.in_effect(model).audit == ("first-step audit: nothing named at its first step",)
    assert "first-step audit: not run on it yet" in str(shim.in_effect(reference))
    assert bugreport.first_step_audit().startswith("On: at each optimizer's first step it warns")
    assert hooks_left(model) == 0, "the first step leaves no hook behind"
    assert optimizer._optimizer_step_pre_hooks == {}


def test_an_audit_that_warnings_make_errors_goes_to_the_logger_never_into_the_step(caplog):
    torch.manual_seed(0)

    class Cut(Routed):
        def forward(self, x, expert=0):
            return self.experts[expert](self.trunk(x).detach())

    model = Cut()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="shim"):
        warnings.simplefilter("error")
        optimizer.step()  # does not raise
    [finding] = audit.findings_of(model)
    assert finding.cause == "cut" and sorted(finding.parameters) == ["trunk.bias", "trunk.weight"]
    assert finding.line() in caplog.text


def test_the_warning_points_at_the_users_step_past_the_libraries_between():
    """Past the shim's frames and torch's (the optimizer's step hooks): the user's ``step()`` line."""
    torch.manual_seed(0)

    class CutToo(Routed):  # a line of its own: a line said already is not said again
        def forward(self, x, expert=0):
            return self.experts[expert](self.trunk(x).detach())

    model = CutToo()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        optimizer.step()
    [warning] = [w for w in caught if w.category is shim.ShimWarning]
    assert (warning.filename, warning.lineno) == (__file__, line), str(warning.message)


def test_an_audit_that_fails_warns_once_and_the_step_goes_on_or_raises_under_strict_mode(monkeypatch):
    """The engine's policy for a part of the shim that fails: one ``ShimWarning`` (the step and
    training go on, every hook off), a ``shim.PatchError`` under ``SHIM_STRICT=1``."""
    from shim import settings

    def broken(trackers, parameters):
        raise RuntimeError("the audit broke")

    monkeypatch.setattr(audit, "audited", broken)
    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.delenv("SHIM_STRICT", raising=False)
    said = "hf-train-shim first-step-audit failed, nothing audited: RuntimeError('the audit broke')"
    models = [Routed() for _ in range(3)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    for model in models:
        model(torch.randn(2, 4)).sum().backward()
    before = models[0].trunk.weight.detach().clone()
    with pytest.warns(shim.ShimWarning) as caught:
        optimizers[0].step()
        optimizers[1].step()  # fails the same way: said once
    assert [str(w.message) for w in caught] == [said]
    assert not torch.equal(models[0].trunk.weight, before), "the step went on"
    monkeypatch.setenv("SHIM_STRICT", "1")
    with pytest.raises(shim.PatchError, match=r"nothing audited: RuntimeError\('the audit broke'\) \(SHIM_STRICT=1\)"):
        optimizers[2].step()
    assert hooks_left(*models) == 0


def test_the_audit_holds_nothing_alive_after_its_step():
    """An optimizer over the head alone, one step, the model dropped: its layers are freed while the
    optimizer lives on (nothing of the audit holds the model, a module or the optimizer)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    layer, whole = weakref.ref(model[0]), weakref.ref(model)
    optimizer_alive = weakref.ref(optimizer)
    head = model[1]
    del model
    gc.collect()
    assert layer() is None and whole() is None, gc.get_referrers(layer()) if layer() is not None else ""
    del head, optimizer
    gc.collect()
    assert optimizer_alive() is None


def test_a_model_copied_or_pickled_before_its_first_step_carries_nothing_of_the_shim():
    """Between the first training forward and the step the audit's hooks are on the model: a deep
    copy (an EMA copy) gets a standard-library no-op in their place, and so does a pickle, which loads
    where the shim cannot be imported (``tests/patches/test_checkpointing_saved_models.py`` loads and
    trains such a model there)."""
    model = Routed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    copied = copy.deepcopy(model)
    hooks = [hook for m in copied.modules() for hook in m._forward_pre_hooks.values()]
    assert hooks and all(type(hook).__module__ == "functools" for hook in hooks), hooks
    copied(torch.randn(2, 4)).sum().backward()  # the copy's no-ops run, and do nothing
    data = pickle.dumps(model)
    assert b"shim.audit" not in data
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert audit.findings_of(model) == () and audit.findings_of(copied) is None


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
            out = super().forward(x, expert)
            self.experts[1](x)  # runs after the path the loss uses, and is left out
            return out

    [finding] = shim.audit_first_step(Unused(), {"x": torch.randn(2, 4)}, loss=lambda out: out.sum())
    assert set(finding.parameters) == {"experts.1.weight", "experts.1.bias"}
    assert finding.cause == "dead-end" and not finding.warns
    assert finding.as_dict()["line"].startswith("hf-train-shim first-step audit")
    with pytest.raises(TypeError, match="no .loss"):
        shim.audit_first_step(Routed(), (torch.randn(2, 4),))


def test_a_compiled_model_is_said_to_be_compiled_not_waiting(monkeypatch):
    """And from torch.compile(module) on, no optimizer waits with a global hook for a module's call
    (the compiled module's calls would warn of it)."""
    monkeypatch.setattr(audit, "_compile_wraps", False)  # put back after: the other tests' optimizers wait
    model = Routed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert "torch.compile compiles it" in shim.in_effect(model).audit[0]
    assert hooks_left(model) == 0
    later = Routed()
    waiting = torch.optim.SGD(later.parameters(), lr=0.1)
    assert hooks_left(later) == 0 and waiting, "no global hook waits for its model's call"


def test_grouping_names_numbered_modules_as_spans():
    names = [f"model.layers.{i}.mlp.down_proj.lora_A.weight" for i in range(32)]
    sizes = dict.fromkeys(names, 32 * 1024)
    assert (
        audit.grouped(names, sizes)
        == "model.layers.{0..31}.mlp.down_proj.lora_A.weight: 32 tensor(s), 1.0 M parameters"
    )
    assert audit.grouped(["a.1.w", "a.3.w"]) == "a.{1,3}.w"


def test_every_patch_the_audit_points_to_is_in_the_catalogue():
    import shim.patches

    names = {row["name"] for row in shim.patches.INDEX}
    assert {name for patches in audit.FIXES.values() for name in patches} <= names


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
