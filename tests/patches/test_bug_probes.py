"""Every built-in patch's bug probe (``Patch.bug_probe``) on the real libraries: it finds the bug where
the gate admits the installed releases and not with the patch on; on a build between releases
(``tests/devbuild.py``: the libraries say a dev version) the stock code gets every patch it needs,
a copy with its fix edited in makes each patch step aside, its library alone, with the same
training outcome with the shim on, off and without it, and a copy with a partial fix keeps the patch
for what is still broken; asking every probe leaves no trace, and answers the same whatever default
dtype, default device, deterministic or anomaly mode the script set first. peft's and DeepSpeed's own
fixes are their releases' (peft 0.21 here; tests/e2e for DeepSpeed)."""

import json
import re
import sys
from pathlib import Path

import pytest

import shim
from shim import gating
from shim.selfcheck import bare
from tests.conftest import run_python
from tests.devbuild import DEV_VERSIONS, FIXES, PARTIAL
from tests.probes import bug_found

INSTALLED = [name for name in shim.registry.names if gating.installed_version(shim.registry.patch(name).distribution)]


def admitted(name: str) -> bool:
    patch = shim.registry.patch(name)
    return gating.check_versions(patch.distribution, patch.specifier).admitted


@pytest.mark.parametrize("name", INSTALLED)
def test_the_probe_finds_the_bug_where_the_gate_admits_the_release_and_none_with_the_patch_on(name):
    from shim.tools.targets import import_targets

    import_targets(shim.registry, [name])
    with shim.disabled(name):
        upstream = bug_found(name)
    with_the_patch = bug_found(name)
    relevant = any(t.requirement is None or gating.check_versions(t.requirement.name, t.requirement.specifier).admitted
                   for t in shim.registry.patch(name).targets)  # fmt: skip
    assert upstream is (admitted(name) and relevant), "the probe and the gate disagree on the installed releases"
    assert with_the_patch is False


@pytest.mark.parametrize("name", list(shim.registry.names))
def test_a_probe_waits_for_what_its_bare_builders_take_and_declares_none_of_it(name):
    """Each ``shim.selfcheck.bare`` builder a patch module calls says what it takes (``needs``), and
    its probes wait for that without declaring it (read from the module's source here, apart from
    how ``BugProbe`` reads it)."""
    waited = {module for probe in shim.registry.patch(name).probes for module in probe.needs}
    source = Path(sys.modules[shim.registry.declared(name).module].__file__).read_text()
    taken = {
        module
        for builder in re.findall(r"\bbare\.(\w+)\(", source)
        for module in getattr(getattr(bare, builder), "needs", ())
    }
    assert taken <= waited
    declared = {
        getattr(bare, constant)
        for needs in re.findall(r"needs=\(([^)]*)\)", source)
        for constant in re.findall(r"bare\.([A-Z_]+)", needs)
    }
    assert not declared & taken, "a module a builder takes is not declared again"


STATUS_ON_A_DEV_BUILD = """
import json
from tests import devbuild
devbuild.install(devbuild.DEV_VERSIONS, fixes={fixes!r})
import shim
from shim.tools.targets import import_targets
import_targets(shim.registry, list(shim.registry.names))
print(json.dumps({{s.name: [str(s.state), s.decided_by, s.reason, s.effects] for s in shim.status()}}))
"""


def status_on_a_dev_build(fixes=()):
    done = run_python(STATUS_ON_A_DEV_BUILD.format(fixes=list(fixes)), torch_first=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def installed(name: str) -> bool:
    return name in INSTALLED


def test_on_a_dev_build_every_probe_finds_the_stock_bugs_and_decides():
    status = status_on_a_dev_build()
    for name, (state, decided_by, reason, _effects) in status.items():
        if not installed(name):
            continue
        if name == "peft-adapter-trainability":  # peft 0.21.0 carries the fix: still outside the gate
            assert (state, decided_by) == ("skipped", "release") and "carries the fix" in reason, reason
            continue
        assert (state, decided_by) == ("applied", "probe"), (name, reason)
        assert "has the bug" in reason and "is a build between releases" in reason, (name, reason)
        assert (
            f"transformers {DEV_VERSIONS['transformers']}" in reason
            or "trl" in reason
            or "peft" in reason
            or ("accelerate" in reason)
        ), reason


#: Patches whose targets are in two libraries: a fix edited into one makes them step aside there only.
IN_ONE_LIBRARY_ONLY = {"checkpointing-call-signature": "trl", "kbit-prepare-keeps-checkpointing": "peft"}


def test_on_a_dev_build_with_the_fixes_edited_in_each_patch_steps_aside_where_its_fix_is():
    status = status_on_a_dev_build(fixes=FIXES)
    for name in FIXES:
        state, decided_by, reason, effects = status[name]
        assert decided_by == "probe" and effects == 0, (name, reason)
        if name in IN_ONE_LIBRARY_ONLY:  # the other library's copy still has the bug: applied there
            library = IN_ONE_LIBRARY_ONLY[name]
            assert state == "applied" and f"steps aside: {library} {DEV_VERSIONS[library]} carries the fix" in reason
        else:
            assert state == "skipped" and "steps aside" in reason and "carries the fix" in reason, (name, reason)
    assert set(FIXES) == set(INSTALLED) - {"peft-adapter-trainability"}, "a fix edited in for every patch here"


OUTCOME = """
import json, os, tempfile
from tests import devbuild
devbuild.install(devbuild.DEV_VERSIONS, fixes=list(devbuild.FIXES))
if os.environ.get("WITH_SHIM"):
    import shim
import torch
from shim.tools.targets import quiet_transformers
from tests.steps import enable_checkpointing, keyword_driven_grads
from tests.tinymodels import frozen_llama_class, tiny_llama_config
quiet_transformers()
torch.manual_seed(0)
cls = frozen_llama_class()
with tempfile.TemporaryDirectory() as folder:
    cls(tiny_llama_config(num_hidden_layers=3)).save_pretrained(folder)
    model = cls.from_pretrained(folder)
model.train()
for _ in range(3):  # trl's cycle around each generation
    enable_checkpointing(model, {"use_reentrant": True})
    model.activation_checkpointing_disable()
enable_checkpointing(model, {"use_reentrant": True})
ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
grads = keyword_driven_grads(model, ids)  # layers called with hidden_states=, reentrant, layer 0 frozen
out = dict(
    hooks=len(model.get_input_embeddings()._forward_hooks),
    trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad),
    grads={n: None if g is None else round(g.double().norm().item(), 6) for n, g in grads.items()},
)
if os.environ.get("WITH_SHIM"):
    out["shim"] = {s.name: [str(s.state), s.effects] for s in shim.status() if s.name in devbuild.FIXES}
print(json.dumps(out))
"""


def test_on_a_dev_build_with_the_fixes_the_run_is_the_same_with_the_shim_on_off_and_without_it():
    """transformers 5.26.0.dev0 that keeps frozen parameters frozen through a load, removes old
    input-grad hooks and gives keyword hidden states their gradients under reentrant checkpointing:
    upstream's fixes act alone, the shim claims no effect."""
    runs = {
        "on": run_python(OUTCOME, env={"WITH_SHIM": "1"}, torch_first=True),
        "off": run_python(OUTCOME, env={"WITH_SHIM": "1", "SHIM_DISABLE": "all"}, torch_first=True),
        "without": run_python(OUTCOME, torch_first=True),
    }
    outcomes = {key: json.loads(done.stdout.strip().splitlines()[-1]) for key, done in runs.items()}
    shim_on = outcomes["on"].pop("shim")
    outcomes["off"].pop("shim")
    assert outcomes["on"] == outcomes["off"] == outcomes["without"]
    assert outcomes["on"]["hooks"] == 1, "upstream's fix: one hook however many cycles"
    assert "model.embed_tokens.weight" not in outcomes["on"]["trainable"], "upstream's fix: kept frozen"
    layer_weights = [n for n in outcomes["on"]["grads"] if n.startswith("model.layers.") and "layers.0." not in n]
    assert layer_weights and all(outcomes["on"]["grads"][n] is not None for n in layer_weights), "upstream's fix"
    assert all(effects == 0 for _state, effects in shim_on.values()), shim_on
    stepped_aside = {name for name, (state, _effects) in shim_on.items() if state == "skipped"}
    assert stepped_aside >= {  # every patch whose target this run imported (training_args, trl: not)
        "load-keeps-requires-grad", "input-grad-hook-dedupe", "frozen-tower-input-grads", "checkpointing-restore",
        "checkpoint-kwargs-clean", "reentrant-keyword-grads", "reentrant-frozen-input-grads",
        "checkpoint-function-finds-layer", "replaced-forward-keeps-checkpointing",
    }, shim_on  # fmt: skip


TRACE = """
import json, os, random, sys
import torch
torch.manual_seed(0)
random.seed(0)
import shim
import transformers.utils.logging as hf_logging
from shim.tools.targets import import_targets
names = list(shim.registry.names)
import_targets(shim.registry, names)
print(json.dumps(dict(
    modules=sorted(sys.modules),
    once=[hf_logging.warning_once.cache_info().currsize, hf_logging.info_once.cache_info().currsize],
    random=[torch.rand(1).item(), random.random()],
    cuda_seeds_queued=len(getattr(torch.cuda, "_queued_calls", ())),  # torch.manual_seed queues one for CUDA
    cuda_initialized=torch.cuda.is_initialized(),
    grad=torch.is_grad_enabled(),
    probes={s.name: s.probe for s in shim.status()},
    effects=sum(s.effects for s in shim.status()),
)))
"""


def test_asking_every_probe_leaves_no_trace():
    """The same process with every probe asked (``SHIM_PROBE=always``) and none asked: the same modules
    imported, the same once-only messages of transformers left to show, the same random draws (and
    no seed queued for a CUDA that initialises later), the same grad mode, no effect counted and
    nothing printed."""
    asked = run_python(TRACE, env={"SHIM_PROBE": "always"}, torch_first=True)
    not_asked = run_python(TRACE, env={"SHIM_PROBE": "never"}, torch_first=True)
    with_probes, without = (json.loads(done.stdout.strip().splitlines()[-1]) for done in (asked, not_asked))
    probes = with_probes.pop("probes")
    assert without.pop("probes") == {name: None for name in probes}
    assert set(with_probes["modules"]) == set(without["modules"]), set(with_probes["modules"]) ^ set(without["modules"])
    assert with_probes == without
    assert asked.stderr == not_asked.stderr
    for name in INSTALLED:
        answers = probes[name]
        assert answers and all(answer["present"] is not None for answer in answers), (name, answers)


AMBIENT = """
import json
import torch
{setting}
import shim
from shim.tools.targets import import_targets
import_targets(shim.registry, list(shim.registry.names))  # every probe asked in the targets' import
print(json.dumps(dict(
    answers={{s.name: [[a["library"], a["present"], a["error"]] for a in s.probe or ()] for s in shim.status()}},
    states={{s.name: str(s.state) for s in shim.status()}},
    ambient=[str(torch.get_default_dtype()), torch.empty(0).device.type, torch.are_deterministic_algorithms_enabled(),
             torch.is_anomaly_enabled()],
)))
"""

#: What a script may set before its imports (big-model scripts set a bf16 default dtype), and what it reads after.
SETTINGS = {
    "nothing": ("", ["torch.float32", "cpu", False, False]),
    "bf16 default dtype": ("torch.set_default_dtype(torch.bfloat16)", ["torch.bfloat16", "cpu", False, False]),
    "fp16 default dtype": ("torch.set_default_dtype(torch.float16)", ["torch.float16", "cpu", False, False]),
    "meta default device": ('torch.set_default_device("meta")', ["torch.float32", "meta", False, False]),
    "deterministic algorithms": ("torch.use_deterministic_algorithms(True)", ["torch.float32", "cpu", True, False]),
    "anomaly mode": ("torch.autograd.set_detect_anomaly(True)", ["torch.float32", "cpu", False, True]),
}


def probed_under(setting: str) -> dict:
    """Every probe asked in a fresh interpreter whose script set ``setting`` first, in strict mode:
    a probe that fails there is a ``PatchError`` (and the interpreter's exit status 1)."""
    code = AMBIENT.format(setting=SETTINGS[setting][0])
    done = run_python(code, env={"SHIM_PROBE": "always", "SHIM_STRICT": "1"}, torch_first=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probed_plainly():
    return probed_under("nothing")


@pytest.mark.parametrize("setting", [name for name in SETTINGS if name != "nothing"])
def test_every_probe_answers_as_in_a_plain_interpreter_whatever_the_script_set_first(setting, probed_plainly):
    """The probes build their cases in float32 on the CPU, with deterministic algorithms and anomaly
    detection off, whatever the script set before its imports; the script has its settings back."""
    out = probed_under(setting)
    assert out["answers"] == probed_plainly["answers"]
    assert out["states"] == probed_plainly["states"]
    assert not [name for name, answers in out["answers"].items() if any(error for _, _, error in answers)]
    assert out["ambient"] == SETTINGS[setting][1]
    assert probed_plainly["ambient"] == SETTINGS["nothing"][1]


PARTIAL_STATUS = """
import json
from tests import devbuild
devbuild.install(devbuild.DEV_VERSIONS, fixes={fixes!r})
import shim
from shim.tools import doctor
from shim.tools.targets import import_targets, quiet_transformers
quiet_transformers()
names = list(shim.registry.names)
import_targets(shim.registry, names)
out = {{}}
for fix in {fixes!r}:
    name = devbuild.PARTIAL[fix][0]
    status = shim.status()[names.index(name)]
    with shim.disabled(name):
        off = {{a.library: a.present for a in doctor.ask(shim.registry.patch(name))}}
    on = {{a.library: a.present for a in doctor.ask(shim.registry.patch(name))}}
    out[fix] = dict(state=str(status.state), decided_by=status.decided_by, reason=status.reason, off=off, on=on)
print(json.dumps(out))
"""

#: Partial fixes that edit the same copy of upstream's code two ways: each in an interpreter of its own.
APART = ("keyword-grads:top-level",)


@pytest.fixture(scope="module")
def partial_builds():
    """Each partial fix's patch on a dev build carrying it: two fresh interpreters, the partial fixes
    that do not touch the same code together."""
    together = [fix for fix in PARTIAL if fix not in APART]
    found = {}
    for fixes in (together, *([fix] for fix in APART)):
        done = run_python(PARTIAL_STATUS.format(fixes=fixes), torch_first=True)
        found |= json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("fix", list(PARTIAL))
def test_on_a_dev_build_with_a_partial_fix_the_patch_stays_for_what_is_still_broken(fix, partial_builds):
    """A build that fixes some of the cases a patch fixes (``tests/devbuild.py``'s ``PARTIAL``:
    transformers lifting ``hidden_states=`` alone into the reentrant checkpoint's inputs, and so on):
    the probe finds the rest, the patch applies there, decided by its probe, and with it on the probe
    finds no bug left."""
    name, pairs = PARTIAL[fix]
    library = pairs[0][0].partition(".")[0]
    found = partial_builds[fix]
    assert (found["state"], found["decided_by"]) == ("applied", "probe"), found["reason"]
    assert f"{library} {DEV_VERSIONS[library]} has the bug" in found["reason"], found["reason"]
    assert "steps aside" not in found["reason"], found["reason"]
    assert found["off"][library] is True and not any(found["on"].values()), found
