"""Do no harm: every run that works without the shim works with it, and ends the same.

Each workflow (``tests/do_no_harm/workflows/``) runs in two fresh interpreters (forked after ``import
torch``, ``tests/zygote.py``), one with ``SHIM_DISABLE=all`` (upstream) and one with the shim on, each
under a hard timeout that ends its whole process group.
A workflow prints, per case, its outcome (or the exception's type and message) and what it produced:
tokens, losses, digests of weights and gradients, for compiled runs the number of graphs and graph
breaks. The two runs must match exactly: torch runs on one thread, so the same computation repeats
bit for bit on CPU. Where a case compares with another computation (compiled against eager, a
checkpointed run against one without), it says the tolerance: ``COMPILED_GRADIENTS`` in
``tests/do_no_harm/workflows/compiled.py``, ``tests.steps.wrong_grads``' defaults elsewhere. A case that
fails without the shim is a broken test, never a pass.

The workflows run on the test device (``--device`` / ``SHIM_TEST_DEVICE``, ``tests/devices.py``), made to
repeat itself bit for bit there; DDP's two gloo ranks stay on the CPU (two ranks on one GPU is not how
anyone trains). On CUDA the compiled cases add ``inductor`` and bf16 autocast cases.

``DO_NO_HARM=full`` runs every ``torch.compile`` combination (Llama and Qwen2; eval, ``generate()``,
training without, with reentrant and with non-reentrant checkpointing; a graph break in every layer
with each checkpoint function of the user's, regional and whole-model; backends ``eager`` and
``aot_eager``) instead of a covering subset; ``DO_NO_HARM=inductor`` (or ``full,inductor``) adds
the ``inductor`` backend, which takes about a minute per case to compile on a CPU, and which the
CUDA device always adds.
"""

import json

import pytest

from tests import devices
from tests.conftest import ROOT, zygote
from tests.do_no_harm.workflows import MARK

pytestmark = pytest.mark.on_device  # every workflow runs on the test device (DDP's gloo ranks on the CPU)
WORKFLOWS = ROOT / "tests" / "do_no_harm" / "workflows"
OPT_IN = devices.opt_in()
DEVICE = devices.chosen()
IGNORED = {"seconds", "cpu", "where"}  # how long a case took, and where it failed: not what it did


def run_workflow(script: str, cases: list, shim: bool, timeout: float) -> dict:
    """``python tests/do_no_harm/workflows/<script> <cases>`` in a fresh interpreter forked after
    ``import torch`` (``tests/zygote.py``: the workflows test nothing torch's import could change,
    and the shim patches nothing of torch), its process group killed after ``timeout`` seconds;
    the workflow's ``{case: record}``."""
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # and each workflow sets torch's one thread first
    if not shim:
        env["SHIM_DISABLE"] = "all"
    path = WORKFLOWS / script
    done = zygote().run(path.read_text(), timeout, env=env, argv=[str(path), *cases])
    if done.returncode is None:
        pytest.fail(
            f"{script} {' '.join(cases)} (shim {'on' if shim else 'off'}) hung for {timeout} s, killed:\n"
            f"{done.stderr[-3000:]}"
        )
    assert done.returncode == 0, (
        f"{script} (shim {'on' if shim else 'off'}) exited {done.returncode}:\n{done.stderr[-3000:]}"
    )
    if shim:  # no false alarm: the first-step audit names nothing in a workflow that trains right
        assert "first-step audit" not in done.stderr, f"{script}: the audit named something:\n{done.stderr[-3000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    assert lines, f"{script} printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len(MARK) :])


def timeout_for(cases: list) -> float:
    """Generous: a case takes seconds; a stuck one must still end the test, not hang CI."""
    return 120 + sum(400 if "inductor" in case else 90 for case in cases)


def off_and_on(script: str, cases: list) -> tuple[dict, dict]:
    """The workflow without the shim, then with it; each case must succeed without it."""
    off = run_workflow(script, cases, shim=False, timeout=timeout_for(cases))
    broken = {case: record["error"] for case, record in off.items() if not record["ok"]}
    assert not broken, f"fails without the shim: the test is broken, not the shim: {broken}"
    on = run_workflow(script, cases, shim=True, timeout=timeout_for(cases))
    for case in cases:  # shown with pytest -rP
        times = (off[case]["seconds"], off[case].get("cpu"), on[case]["seconds"], on[case].get("cpu"))
        print(f"{script} {case}: off %s s (CPU %s s), on %s s (CPU %s s)" % times)
    return off, on


def differences(off, on, path: str = "") -> list:
    """Where two records differ, as ``path: off ..., on ...`` lines (``seconds`` and ``where`` aside)."""
    if isinstance(off, dict) and isinstance(on, dict):
        found = []
        for key in [*off, *(key for key in on if key not in off)]:
            if key in IGNORED:
                continue
            if key not in off or key not in on:
                found.append(
                    f"{path}/{key}: only {'on' if key in on else 'off'}: {(on if key in on else off)[key]!r:.300}"
                )
            else:
                found += differences(off[key], on[key], f"{path}/{key}")
        return found
    if isinstance(off, list) and isinstance(on, list) and len(off) == len(on):
        return [line for i, (a, b) in enumerate(zip(off, on)) for line in differences(a, b, f"{path}[{i}]")]
    return [] if off == on else [f"{path}: off {off!r:.300}, on {on!r:.300}"]


def assert_same(off: dict, on: dict, cases: list) -> None:
    found = [line for case in cases for line in differences(off[case], on[case], case)]
    where = "\n".join(on[case]["where"] for case in cases if "where" in on[case])
    assert not found, "the shim changed what these runs do:\n" + "\n".join(found) + "\n" + where[-4000:]


# -- 1: everyday workflows ------------------------------------------------------------------------

EVERYDAY = ["generate", "save-load", "copy-pickle", "branch-trainable", "branch-frozen", "trainer-model-init"]
EVERYDAY += ["own-checkpoint-function", "replaced-forward", "fsdp2-activation-checkpointing"]
EVERYDAY += ["reentrant-round-trip-cycle", "checkpoint-function-args", "compiled-layer-forward"]
EVERYDAY += ["self-checkpointing-forward", "staticmethod-forward", "replaced-forward-switched-off"]
EVERYDAY += ["training-arguments"]
EVERYDAY += ["trl-sft-checkpointing"]
EVERYDAY += ["kbit-prepare"]
EVERYDAY += ["saved-models-load", "checkpoint-function-copies"]


def test_everyday_workflows_end_as_without_the_shim():
    """``generate()``, save/load, deepcopy and pickle, ``Trainer(model_init=...)``, and a layer whose
    trainable branch runs on some calls only under reentrant checkpointing, in one interpreter each
    way (``tests/do_no_harm/workflows/everyday.py`` describes them)."""
    off, on = off_and_on("everyday.py", EVERYDAY)
    problems = [line for case in EVERYDAY if case != "branch-frozen" for line in differences(off[case], on[case], case)]
    problems += frozen_branch_problems(off["branch-frozen"], on["branch-frozen"])
    for run in (off, on):
        for reentrancy, copies in run["copy-pickle"].items():
            if isinstance(copies, dict) and not copies["deepcopy"] == copies["original"] == copies["pickle"]:
                problems.append(f"copy-pickle/{reentrancy}: a copy trains unlike its original: {copies}")
        if run["branch-trainable"].get("match") is False:
            problems.append(
                f"branch-trainable: checkpointed steps differ from steps without: {run['branch-trainable']}"
            )
    where = "\n".join(on[case]["where"] for case in EVERYDAY if "where" in on[case])
    assert not problems, "\n".join(problems) + "\n" + where[-4000:]


def frozen_branch_problems(upstream: dict, with_shim: dict) -> list:
    """``branch-frozen``: the inputs of layer 1 require no grad and its only trainable part, a branch,
    runs on the second of three steps. Upstream completes every step and is right on the steps the
    branch is off (nothing in the layer trains); on the step it is on, the branch gets no gradient
    (the reentrant-frozen-input-grads bug). With the shim every step must complete, every gradient
    equal the run without checkpointing, and the steps the branch is off equal upstream's."""
    if not with_shim["ok"]:
        return [f"branch-frozen: fails with the shim: {with_shim['error']}"]
    problems = (
        []
        if with_shim["match"]
        else [f"branch-frozen: gradients differ from the run without checkpointing: {with_shim['steps']}"]
    )
    for index, (before, after) in enumerate(zip(upstream["steps"], with_shim["steps"])):
        if not before["branch"]:  # the layer has nothing to train on this step: no fix, the same run
            problems += differences(before, after, f"branch-frozen/steps[{index}]")
    return problems


def test_ddp_with_an_unused_parameter_trains_as_without_the_shim():
    cases = ["none", "non-reentrant"]
    off, on = off_and_on("ddp.py", cases)
    assert_same(off, on, cases)
    for case in cases:
        ranks = off[case]["ranks"]
        assert ranks[0]["weights"] == ranks[1]["weights"], "DDP keeps the ranks' weights equal"


# -- 2: torch.compile ------------------------------------------------------------------------------

BACKENDS = devices.backends(DEVICE, OPT_IN)
MODELS = ["llama", "qwen2"]
if "full" in OPT_IN:
    COMPILED = [
        f"{model}/{kind}/{backend}" for model in MODELS for kind in ("eval", "generate") for backend in BACKENDS
    ]
    COMPILED += [
        f"{model}/train-{checkpointing}/{backend}"
        for model in MODELS
        for checkpointing in ("none", "reentrant", "non-reentrant")
        for backend in BACKENDS
    ]
    COMPILED += [f"{fix}/{backend}" for fix in ("fix-keyword", "fix-frozen-input") for backend in BACKENDS]
    COMPILED += [
        f"graph-break/{function}/{backend}/{how}"
        for function in ("closure", "partial", "args0")
        for backend in BACKENDS
        for how in ("regional", "whole")
    ]
else:  # every model, kind, checkpointing and backend at least once; each function of the user's, each way
    COMPILED = ["llama/eval/eager", "qwen2/generate/eager", "llama/train-reentrant/aot_eager"]
    COMPILED += ["qwen2/train-non-reentrant/aot_eager", "qwen2/train-none/eager"]
    COMPILED += ["fix-keyword/aot_eager", "fix-frozen-input/aot_eager"]
    COMPILED += ["graph-break/closure/eager/whole", "graph-break/partial/aot_eager/regional"]
    COMPILED += ["graph-break/args0/eager/regional"]
    if "inductor" in BACKENDS:
        COMPILED += ["llama/eval/inductor", "llama/train-reentrant/inductor"]
if DEVICE == "cuda":  # the two fixes on the default backend, and training under bf16 autocast
    ON_CUDA = ["fix-keyword/inductor", "fix-frozen-input/inductor", "fix-keyword/aot_eager/bf16"]
    ON_CUDA += ["llama/train-reentrant/inductor/bf16", "qwen2/train-non-reentrant/aot_eager/bf16"]
    COMPILED += [case for case in ON_CUDA if case not in COMPILED]


def test_torch_compile_works_as_without_the_shim():
    """Stock Llama and Qwen2 compiled: eval forward, ``generate()``, training steps, each as without
    the shim; training with a graph break in every decoder layer and a checkpoint function of the
    user's own (a closure, a partial, one that finds its layer), compiled per layer and whole, too
    (today's shim: ``InternalTorchDynamoError: RecursionError``). And the two cases the reentrant patches fix, compiled (``fix-*``): with the shim their
    gradients equal the uncompiled run without checkpointing, in as many graphs as upstream's. Where
    the checkpoint call is inside the compiled code, upstream already gets them right (dynamo makes
    ``torch.utils.checkpoint`` its own operator) and the shim must change nothing; where it is not
    (a layer compiled on its own before transformers 5.23, whose ``__call__`` checkpoints), upstream
    shows the bug and the shim must fix it (``tests/do_no_harm/workflows/compiled.py``)."""
    off, on = off_and_on("compiled.py", COMPILED)
    stock = [case for case in COMPILED if not case.startswith("fix-")]
    mismatched = {case: off[case].get("wrong") for case in stock if not off[case]["match"]}
    assert not mismatched, f"compiled differs from eager without the shim: the test is broken: {mismatched}"
    problems = [line for case in stock for line in differences(off[case], on[case], case)]
    for case in COMPILED:
        if case in stock:
            continue
        if not (on[case]["ok"] and on[case]["match"]):
            problems.append(f"{case}: with the shim, not the gradients of the run without checkpointing: {on[case]}")
        elif off[case]["match"]:  # nothing to fix: the same run
            problems += differences(off[case], on[case], case)
        else:  # upstream's bug, fixed: the same graphs, broken for the same reasons. Not always as
            # often: the fix makes a layer's input require grad where upstream's did not, and dynamo's
            # guard on requires_grad recompiles a frame that breaks (measured on transformers 5.25 with
            # kernels: off 5, on 6 breaks with frozen inputs; off 2, on 1 with keyword tensors).
            problems += differences(
                {key: off[case][key] for key in ("graphs", "reasons")},
                {key: on[case][key] for key in ("graphs", "reasons")},
                case,
            )
    where = "\n".join(on[case]["where"] for case in COMPILED if "where" in on[case])
    assert not problems, "\n".join(problems) + "\n" + where[-4000:]


# -- 3: no shim code where no fix can be needed ----------------------------------------------------


def test_calls_that_cannot_need_a_fix_run_no_shim_code():
    cases = ["applied", "eval", "eval-grad", "generate", "train", "control"]
    run = run_workflow("shim_frames.py", cases, shim=True, timeout=timeout_for(cases))
    failed = {case: record["error"] for case, record in run.items() if not record["ok"]}
    assert not failed, failed
    assert run["applied"]["patches"], "no patch applied: nothing to test"
    assert run["control"]["shim frames"], "the tracer saw no shim frame in shim.status(): it sees nothing"
    entered = {case: run[case]["shim frames"] for case in ("eval", "eval-grad", "generate", "train")}
    assert entered == {case: [] for case in entered}, entered
