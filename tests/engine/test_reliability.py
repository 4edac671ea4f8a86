"""The shim in the world it runs in: threads importing at the same moment, a meta-device init, tools
that patch ``nn.Module.__call__``, pickling and copying, reloads. Each case failed on the shim
before this file existed and passes now; thread cases run in subprocesses with hard timeouts, so a
regression fails instead of hanging the suite."""

import copy
import functools
import importlib
import itertools
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import shim
from shim import patches as catalogue
from shim.patches._checkpointing_calls import enable
from shim.patches._checkpointing_state import layer_state
from shim.wrapping import patch_names_of
from tests.conftest import ROOT, clean_environment
from tests.engine_state import shim_wrapper
from tests.patches.checkpointing_cases import quietly, tiny_llama
from tests.tinymodels import tiny_llama_config
from tests.zygote import Zygote

ON_5_23 = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")


def run_script(code: str, timeout: int = 120, env: dict | None = None, zygote: Zygote | None = None) -> dict:
    """Run ``code`` in a fresh interpreter, killed after ``timeout`` seconds; its last line is JSON.
    ``zygote``: forked from one that has imported torch (for a script that starts with it)."""
    if zygote is not None:
        result = zygote.run(textwrap.dedent(code), timeout)
        if result.returncode is None:
            pytest.fail(f"hung for {timeout} s (killed):\n{result.stderr[-3000:]}")
    else:
        try:
            result = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(code)],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
                env=clean_environment(env),
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"hung for {timeout} s (killed):\n{(exc.stderr or b'')[-3000:]!r}")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def zygotes():
    """Two interpreters that have imported torch (the machine's two cores), for the scripts that
    start with ``import torch``: each case is still a fresh interpreter from there on."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        started = list(pool.map(lambda _: Zygote(clean_environment()), range(2)))
    yield started
    for zygote in started:
        zygote.close()


# -- 1, 2: threads importing at the same moment ------------------------------------------------------

THREADED_IMPORTS = """
import importlib, json, sys, threading
with_shim = {with_shim!r}
if with_shim:
    import shim
    from tests.engine_state import watchers_done
names = {names!r}
errors, threads = [], []
barrier = threading.Barrier(len(names))
def work(name):
    try:
        barrier.wait(30)
        importlib.import_module(name)
    except BaseException as exc:
        errors.append(repr(exc))
for name in names:
    threads.append(threading.Thread(target=work, args=(name,), daemon=True))
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(90)
alive = [thread.is_alive() for thread in threads]
states = {{}}
if with_shim:
    watchers_done(30)
    for name in names:  # one thread at a time now: what a failed import left undone
        importlib.import_module(name)
    watchers_done(30)
    states = {{s.name: s.state for s in shim.status()}}
print(json.dumps({{"alive": alive, "errors": errors, "states": states}}))
"""

#: What a thread meets when another is still executing a module it needs (Python's deadlock
#: avoidance hands it the partially initialised module): the failures of an upstream that is not
#: safe to import from several threads at once, with or without the shim. ``_DeadlockError``: one
#: thread imports a package while another imports its submodule, which the package imports too; the
#: two take the module locks in opposite orders and importlib's detector raises (python/cpython#83065,
#: fixed in importlib by locking parents first; seen here for ``transformers.utils``).
PARTIAL_MODULE_ERRORS = ("ImportError", "AttributeError", "KeyError", "_DeadlockError")


# The scripts fork from a zygote that has imported torch: the threads race on the module locks of
# transformers, trl and their packages and on the shim's finder, which watches no torch module;
# torch's own import (4 CPU-seconds a script) only held the threads apart on its lock.


@functools.cache
def upstream_threaded_errors(names: tuple[str, ...], zygote: Zygote) -> tuple[str, ...]:
    """The errors of the same threaded imports without the shim, in this environment (measured once)."""
    code = THREADED_IMPORTS.format(names=list(names), with_shim=False)
    return tuple(run_script(code, timeout=150, zygote=zygote)["errors"])


@pytest.mark.parametrize(
    "names",
    [
        ["transformers", "transformers.modeling_utils"],
        ["transformers.modeling_utils", "transformers", "transformers.modeling_layers", "trl.models.utils"],
    ],
    ids=["2 threads", "4 threads"],
)
@pytest.mark.parametrize("attempt", range(3))
def test_threads_importing_transformers_and_its_modules_at_once_finish(names, attempt, zygotes):
    out = run_script(THREADED_IMPORTS.format(names=names, with_shim=True), timeout=150, zygote=zygotes[0])
    assert out["alive"] == [False] * len(names), "a thread hung: the shim deadlocked the imports"
    upstream = upstream_threaded_errors(tuple(names), zygotes[0])
    if upstream:
        # Measured: transformers 4.57 and trl 0.25 imported from two threads at once fail without
        # the shim too. The shim may then add no other kind of failure.
        assert all(error.startswith(PARTIAL_MODULE_ERRORS) for error in out["errors"]), (out["errors"], upstream)
    else:
        assert out["errors"] == []
    assert "failed" not in out["states"].values() and "applied" in out["states"].values(), out["states"]


RACE = """
import json, sys, threading, time
import transformers  # the package; its model code is imported by the thread below
thread = threading.Thread(target=lambda: __import__("transformers.modeling_layers"), daemon=True)
thread.start()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # wait until the thread is inside modeling_layers' body
    module = sys.modules.get("transformers.modeling_layers")
    if module is not None and getattr(module.__spec__, "_initializing", False):
        break
    time.sleep(0.0005)
caught_executing = getattr(sys.modules.get("transformers.modeling_layers"), "__spec__", None)
caught_executing = bool(getattr(caught_executing, "_initializing", False))
import shim  # while the other thread is still executing the target module
thread.join(90)
from tests.engine_state import watchers_done
watchers_done(30)
status = {s.name: [s.state, s.reason] for s in shim.status()}
print(json.dumps({"caught_executing": caught_executing, "alive": thread.is_alive(),
                  "reentrant-keyword-grads": status["reentrant-keyword-grads"]}))
"""


def test_import_shim_while_another_thread_executes_a_target_module_applies_the_patch(zygotes):
    out = run_script(RACE, timeout=150, zygote=zygotes[0])
    assert out["caught_executing"], "the race window was not hit: the test proves nothing"
    assert not out["alive"]
    assert out["reentrant-keyword-grads"][0] == "applied", out["reentrant-keyword-grads"][1]


# -- 3: the ambient state of the first import --------------------------------------------------------

AMBIENT = """
import json, torch, transformers
import shim
from shim.tools.targets import quiet_transformers
from tests.tinymodels import tiny_llama_config
quiet_transformers()
context = {context}
with context:  # the model classes are first imported in here
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
torch.set_default_dtype(torch.float32)
from tests.probes import bug_found
status = {{s.name: [s.state, s.reason] for s in shim.status()}}
with shim.disabled():
    upstream = bug_found("reentrant-keyword-grads")
print(json.dumps({{"status": status["reentrant-keyword-grads"], "bug_upstream": upstream,
                  "bug_with_shim": bug_found("reentrant-keyword-grads")}}))
"""

CONTEXTS = {
    "meta device": 'torch.device("meta")',
    "inference mode": "torch.inference_mode()",
    "no grad": "torch.no_grad()",
    "bfloat16 default": "__import__('contextlib').nullcontext(torch.set_default_dtype(torch.bfloat16))",
}


@pytest.mark.parametrize("context", CONTEXTS, ids=list(CONTEXTS))
def test_the_first_import_inside_any_ambient_torch_state_still_applies_the_patch(context, zygotes):
    out = run_script(AMBIENT.format(context=CONTEXTS[context]), timeout=180, zygote=zygotes[0])
    assert out["status"][0] == "applied", out["status"][1]
    assert (out["bug_upstream"], out["bug_with_shim"]) == (True, False)


# -- 4: tools that patch nn.Module.__call__ ----------------------------------------------------------


class _Block(importlib.import_module("transformers.modeling_layers").GradientCheckpointingLayer):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x)


def test_torch_fx_and_torch_ao_still_see_the_layers_as_modules():
    import torch.fx
    from torch.ao.quantization.utils import get_fqn_to_example_inputs

    class LeafBlocks(torch.fx.Tracer):
        def is_leaf_module(self, module, qualified_name):
            return isinstance(module, _Block) or super().is_leaf_module(module, qualified_name)

    assert shim.registry.is_on("reentrant-keyword-grads")
    graph = LeafBlocks().trace(_Net())
    assert [node.target for node in graph.nodes if node.op == "call_module"] == ["block"]
    assert sorted(get_fqn_to_example_inputs(_Net(), (torch.zeros(1, 4),))) == ["", "block", "block.lin"]


# -- 5, 6: wrapped functions look like the originals ---------------------------------------------------


def wrapped_targets():
    """(owner, attribute, patch) for every shim layer in place now, found through the registry."""
    import wrapt

    found = []
    for name in shim.registry.names:
        for target in shim.registry.patch(name).targets:
            module = sys.modules.get(target.module)
            if module is None:
                continue
            try:
                owner, attribute, current = wrapt.resolve_path(module, target.path)
            except Exception:
                continue
            if shim_wrapper(current, name) is not None:
                found.append((owner, attribute, name))
    return found


def test_every_wrapped_function_pickles_and_copies_like_the_original():
    importlib.import_module("trl.models.utils")
    targets = wrapped_targets()
    assert len(targets) >= 6
    for owner, attribute, _name in targets:
        function = getattr(owner, attribute)
        assert pickle.loads(pickle.dumps(function)) is function, f"{owner}.{attribute}"
        assert copy.deepcopy(function) is function and copy.copy(function) is function


def test_bound_wrapped_methods_pickle_and_copy_like_bound_methods():
    model = tiny_llama(layers=2)
    wrapped = {attribute for owner, attribute, _name in wrapped_targets() if owner is transformers.PreTrainedModel}
    assert "_set_gradient_checkpointing" in wrapped  # checkpointing-restore, on every release it supports
    for name in ("enable_input_require_grads", "_set_gradient_checkpointing"):
        bound = getattr(model, name)
        # A shim layer exactly where the registry says one is (enable_input_require_grads: transformers >= 5.0).
        function = type(model).__dict__.get(name) or getattr(transformers.PreTrainedModel, name)
        assert bool(patch_names_of(function)) == (name in wrapped), name
        restored = pickle.loads(pickle.dumps(bound))
        assert type(restored.__self__) is type(model) and restored.__self__ is not model
        assert copy.copy(bound).__self__ is model
        assert copy.deepcopy(bound).__self__ is not model


def test_a_stock_model_compares_as_stock():
    model = tiny_llama(layers=2)
    for owner, attribute, _name in wrapped_targets():
        assert getattr(owner, attribute) is getattr(owner, attribute), f"{owner.__name__}.{attribute}"
        if isinstance(owner, type) and isinstance(model, owner):
            assert getattr(model, attribute).__func__ is getattr(owner, attribute), attribute
    if ON_5_23:  # transformers' own identity test
        for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable", "enable_input_require_grads"):
            assert not model._is_overridden(name), name

        class Overrides(transformers.LlamaForCausalLM):
            def activation_checkpointing_enable(self, *args, **kwargs):
                return super().activation_checkpointing_enable(*args, **kwargs)

        assert Overrides(tiny_llama_config())._is_overridden("activation_checkpointing_enable")


def test_calling_a_wrapped_method_through_the_class_binds_its_first_argument():
    model = tiny_llama(layers=4)
    quietly(enable, model, {"use_reentrant": True, "preserve_rng_state": False})
    configured = layer_state(model)
    transformers.PreTrainedModel._set_gradient_checkpointing(model, enable=False)  # the capture sees the model
    quietly(enable, model, None)
    assert {k: dict(f.keywords) for k, (_, f) in layer_state(model).items()} == {
        k: dict(f.keywords) for k, (_, f) in configured.items()
    }


# -- 7: declarations, reloads -------------------------------------------------------------------------


def test_a_target_without_a_callable_wrapper_is_refused_at_declaration():
    with pytest.raises(TypeError, match="the wrapper must be a callable"):
        shim.Target("json:dumps", None)
    for keyword in ("check", "probe"):  # probe=: the shape check's old name
        with pytest.raises(TypeError, match="the shape check must be a callable"):
            shim.Target("json:dumps", lambda *a: None, **{keyword: "not callable"})


RELOAD = """
import importlib, json
import shim
import transformers.modeling_utils as modeling_utils
from tests.engine_state import shim_wrapper
importlib.reload(modeling_utils)
layer = modeling_utils.PreTrainedModel.__dict__["_set_gradient_checkpointing"]
status = {s.name: s.state for s in shim.status()}
print(json.dumps({"wrapped": shim_wrapper(layer, "checkpointing-restore") is not None,
                  "state": status["checkpointing-restore"]}))
"""


def test_a_reloaded_target_module_is_patched_again():
    assert run_script(RELOAD) == {"wrapped": True, "state": "applied"}


# -- the reentrant fix under the shim, end to end, as a permutation of import orders ------------------

STEPS = {
    "shim": "import shim",
    "transformers": "import transformers",
    "trl": "import trl",
    "model": "model = build()",
}
PERMUTATION = """
import json, sys, threading, itertools
from importlib._bootstrap import _DeadlockError
import torch
meta = {meta!r}
def build():
    # Through the model's own modules: transformers' top-level lazy module is itself not safe to
    # read from one thread while another is still importing it (upstream, with or without the shim).
    from transformers.models.llama import configuration_llama, modeling_llama
    config = configuration_llama.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    if meta:
        with torch.device("meta"):
            return modeling_llama.LlamaForCausalLM(config)
    return modeling_llama.LlamaForCausalLM(config)
steps = {steps!r}
order = {order!r}
TARGET_MODULES = {targets!r}
def run(step):
    exec(steps[step], globals())
if {threads}:
    # transformers itself is not safe to import from several threads at once: with or without the
    # shim, a thread can meet a partially initialised module (ImportError, AttributeError; KeyError
    # for a parent package that a failed import took out of sys.modules). Such a step runs again
    # once the others are done; a hang or any other error fails the test.
    failed, errors = [], []
    def guarded(step):
        try:
            run(step)
        except ({partial_errors}):
            failed.append(step)
        except BaseException as exc:
            errors.append(repr(exc))
    threads = [threading.Thread(target=guarded, args=(step,), daemon=True) for step in order]
    for thread in threads: thread.start()
    for thread in threads: thread.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, ("a thread hung or failed", errors)
    for step in failed:
        run(step)
else:
    for step in order:
        run(step)
import shim, importlib, importlib.util
for target_module in TARGET_MODULES:  # every target module there is, as in the test's process
    try:
        importlib.import_module(target_module)
    except ImportError:
        pass
from shim.wrapping import patch_names_of
from tests.engine_state import watchers_done
import wrapt
watchers_done(30)
layers = {{}}
for name in shim.registry.names:
    for target in shim.registry.patch(name).targets:
        module = sys.modules.get(target.module)
        try:
            current = wrapt.resolve_path(module, target.path)[2]
        except Exception:
            continue
        layers[name + " " + target.spec] = sum(1 for e in wrapt.wrapper_chain(current) if name in patch_names_of(e))
from tests.probes import bug_found
with shim.disabled():
    upstream = bug_found("reentrant-keyword-grads")
print(json.dumps({{"states": {{s.name: s.state for s in shim.status()}}, "layers": layers,
                  "fix": [upstream, bug_found("reentrant-keyword-grads")]}}))
"""


#: The chosen orders: for each set of steps that can come before ``import shim`` (nothing; transformers,
#: trl or the model's modules alone; two of them; all three) one order, so the shim arrives at every
#: position and with every combination of already-imported targets; what follows it varies too.
CHOSEN = [
    ("shim", "transformers", "trl", "model"),
    ("transformers", "shim", "model", "trl"),
    ("trl", "shim", "transformers", "model"),
    ("model", "shim", "trl", "transformers"),
    ("transformers", "trl", "shim", "model"),
    ("model", "transformers", "shim", "trl"),
    ("trl", "model", "shim", "transformers"),
    ("transformers", "trl", "model", "shim"),
]


def permutations() -> list:
    """The cases: (order, meta device, threads).

    By default (and in the version matrix) the chosen orders once each, the model built on the meta
    device on every other one, and the threaded case (every step in its own thread at once) twice each
    way. ``SHIM_EXHAUSTIVE=1``: all 24 orders, each with meta on and off.
    """
    import os

    if os.environ.get("SHIM_EXHAUSTIVE", "").strip().lower() in ("1", "true", "yes", "on"):
        orders = list(itertools.permutations(STEPS))
        cases = [(order, meta, 0) for meta in (False, True) for order in orders]
    else:
        cases = [(order, index % 2 == 1, 0) for index, order in enumerate(CHOSEN)]
    cases += [(tuple(STEPS), meta, 4) for meta in (False, True) for _ in range(2)]
    return cases


CASES = permutations()
TARGET_MODULES = sorted({module for row in catalogue.INDEX for module in row["modules"]})


def case_id(case) -> str:
    order, meta, threads = case
    return f"{'meta, ' if meta else ''}{'4 threads' if threads else '-'.join(order)}"


@pytest.fixture(scope="module")
def permutation_results(zygotes):
    """Every case in its own interpreter, two at a time (the machine's cores), run once for all."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    idle: queue.Queue = queue.Queue()
    for zygote in zygotes:
        idle.put(zygote)

    def run(case):
        order, meta, threads = case
        try:
            code = PERMUTATION.format(
                meta=meta,
                steps=STEPS,
                order=order,
                threads=threads,
                targets=TARGET_MODULES,
                partial_errors=", ".join(PARTIAL_MODULE_ERRORS),
            )
            zygote = idle.get()
            try:
                return run_script(code, timeout=240, zygote=zygote)
            finally:
                idle.put(zygote)
        except BaseException as exc:  # pytest.fail inside a pool thread: report it in the case's test
            return {"error": repr(exc)}

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(range(len(CASES)), pool.map(run, CASES)))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{i}: {case_id(c)}" for i, c in enumerate(CASES)])
def test_every_import_order_ends_with_each_patch_applied_once_and_the_fix_shown(index, permutation_results):
    out = permutation_results[index]
    assert "error" not in out, out.get("error")
    for name in TARGET_MODULES:  # as in the subprocess, so the states compare
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    expected = {s.name: s.state for s in shim.status() if s.name in out["states"]}
    assert out["states"] == expected, "the same states as in this process, whatever the order"
    assert set(out["layers"].values()) <= {0, 1} and 1 in out["layers"].values(), out["layers"]
    assert out["fix"] == [True, False]


# -- fork while another thread holds one of the shim's locks -------------------------------------------

FORK_SETUP = """
import importlib, json, os, signal, sys, tempfile, threading, time
import shim
from shim import Patch, Registry, Target, importhooks
from shim import runtime as effects
root = tempfile.mkdtemp()
pkg = "forked_targets"
os.makedirs(os.path.join(root, pkg))
for name in ["__init__", "busy"] + [f"child{{i}}" for i in range({children})]:
    with open(os.path.join(root, pkg, name + ".py"), "w") as file:
        file.write('__version__ = "1.0"\\n' if name == "__init__" else "def f(x):\\n    return x\\n")
sys.path.insert(0, root)
def passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)
def slow_failing_check(original):  # runs under the registry's lock, each time enable() retries it
    time.sleep(0.002)
    raise RuntimeError("a shape check that takes its time")
busy = Patch("busy", "s", pkg, ">=1", (Target(pkg + ".busy:f", passthrough, check=slow_failing_check),))
waiting = Patch("waiting", "s", pkg, ">=1", tuple(Target(f"{{pkg}}.child{{i}}:f", passthrough) for i in range({children})))
registry = Registry([busy, waiting])
importlib.import_module(pkg + ".busy")
registry.activate()
stop = threading.Event()
def hold(which):  # one of the shim's locks, held nearly all the time
    while not stop.is_set():
        if which == "registry":
            registry.enable("busy")
        else:
            with (importhooks._lock if which == "import hooks" else effects._lock):
                time.sleep(0.002)
        time.sleep(0.0002)
"""

FORKS = (
    FORK_SETUP
    + """
hung, codes = [], []
for which in ("registry", "import hooks", "effects ledger"):
    stop.clear()
    thread = threading.Thread(target=hold, args=(which,), daemon=True)
    thread.start()
    time.sleep(0.02)
    for i in range({forks}):
        child = len(codes)
        pid = os.fork()
        if pid == 0:  # what a worker does: import a target (import hooks, registry), record an effect
            importlib.import_module(f"{{pkg}}.child{{child}}")
            effects.record("busy", "an effect in a child")
            os._exit(0 if registry.is_on("waiting") else 3)
        deadline = time.monotonic() + 10
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung.append(which)
                break
            time.sleep(0.002)
        else:
            codes.append(0)
            continue
        break
    stop.set()
    thread.join()
    if hung:
        break
print(json.dumps({{"hung": hung, "forks": len(codes)}}))
"""
)


def test_fork_while_a_thread_holds_any_of_the_shims_locks_never_hangs_the_child():
    # The child of a fork made while another thread held the registry's lock used to wait on it
    # forever (1 fork in about 170 while a thread applied patches; here the lock is held nearly all
    # the time). Each child imports a target, which takes the import hooks' and the registry's
    # locks, and records an effect.
    out = run_script(FORKS.format(children=3 * 25, forks=25), timeout=300)
    assert out == {"hung": [], "forks": 75}


DATALOADER = (
    FORK_SETUP
    + """
import torch
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return {children}
    def __getitem__(self, i):  # a target module first imported in the worker
        importlib.import_module(f"{{pkg}}.child{{i}}")
        return torch.tensor(float(registry.is_on("waiting")))
thread = threading.Thread(target=hold, args=("registry",), daemon=True)
thread.start()
time.sleep(0.02)
values = []
for epoch in range(4):
    loader = torch.utils.data.DataLoader(Data(), num_workers=2, multiprocessing_context="fork", timeout=30)
    values += [float(value) for value in loader]
stop.set()
print(json.dumps(values))
"""
)


def test_a_fork_started_dataloader_worker_imports_a_target_while_a_thread_applies_patches():
    assert run_script(DATALOADER.format(children=8), timeout=300) == [1.0] * 32


STATUS_FORKS = """
import contextlib, json, os, random, signal, threading, time
import shim
def wait(pid, seconds):  # the child's exit code, or "hung" (killed after ``seconds``)
    deadline = time.monotonic() + seconds
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.002)
    return os.waitstatus_to_exitcode(done[1])
def first_statuses():
    # A process whose threads read the status for the first time, importing what it needs (the
    # first 30 ms of the first status): forked at random moments of that, each child reads its own.
    forked = threading.Event()
    def read():
        while not forked.is_set():
            shim.status()
    for _ in range(2):
        threading.Thread(target=read, daemon=True).start()
    start, children = time.monotonic(), []
    for moment in sorted(random.uniform(0, {window}) for _ in range({per_process})):
        time.sleep(max(0.0, start + moment - time.monotonic()))
        child = os.fork()
        if child == 0:
            shim.status()
            os._exit(0)
        children.append(child)
    forked.set()
    for child in children:
        if wait(child, 10) != 0:
            for other in children:  # none is left behind, holding the test's output open
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
            os._exit(1)
    os._exit(0)
forks, hung = 0, 0
while forks < {forks} and not hung:
    pids = []
    for _ in range(2):  # two at a time: the machine's cores
        pid = os.fork()
        if pid == 0:
            try:
                first_statuses()
            finally:
                os._exit(2)  # whatever happened, this process never runs the loop
        pids.append(pid)
    forks += 2 * {per_process}
    hung += sum(wait(pid, 60) != 0 for pid in pids)
print(json.dumps({{"forks": forks, "hung": hung}}))
"""


def test_no_child_forked_while_threads_read_the_status_hangs_on_the_shims_lazy_imports():
    # A thread reading the status for the first time imports shim.statuses (and what it imports); a
    # child forked during that import waited forever for Python's lock on the module (36 children in
    # 40 forked inside that window hung). The forking thread now waits for such an import to finish.
    out = run_script(STATUS_FORKS.format(forks=200, per_process=10, window=0.035), timeout=300)
    assert out == {"forks": 200, "hung": 0}


# -- an import hook installed in front of the shim's (typeguard, jaxtyping) -------------------------------

FINDER_IN_FRONT = """
import importlib.machinery, json, sys
import shim
class FrontLoader(importlib.machinery.SourceFileLoader):
    pass
class FinderInFront:  # what typeguard.install_import_hook(["transformers.modeling_utils"]) installs
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers.modeling_utils":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        spec.loader = FrontLoader(spec.loader.name, spec.loader.path)
        return spec
sys.meta_path.insert(0, FinderInFront())
import transformers.modeling_utils
from tests.engine_state import watchers_done
watchers_done(30)
print(json.dumps({s.name: [s.state, s.reason] for s in shim.status()}))
"""


def test_a_finder_in_front_of_the_shims_leaves_no_patch_pending():
    # modeling_utils is imported by the finder in front, and imports core_model_loading through the
    # shim's finder on its way: that import notices modeling_utils, and its patches apply once it
    # has finished. They used to stay pending, "applies when transformers.modeling_utils is imported".
    out = run_script(FINDER_IN_FRONT, timeout=180)
    state, reason = out["checkpointing-restore"]
    assert state == "applied", reason
    assert "late: transformers.modeling_utils was imported without passing the shim's import hook" in reason
    assert all(state != "pending" or "modeling_utils" not in reason for state, reason in out.values()), out
