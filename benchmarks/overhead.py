#!/usr/bin/env python
"""What ``import shim`` costs: every patch, shim on against shim off, in one run.

    python benchmarks/overhead.py            # full run (a few minutes on 2 busy cores)
    python benchmarks/overhead.py --quick    # CI smoke: few repeats, small models (~1 min)

Run it with the interpreter of the environment to measure (``.venv/bin/python``); it puts the
checkout it lives in first on ``sys.path``. It never fails on a ratio: it prints the numbers and
whether each target holds. Two kinds of "off" are measured and always labelled:

- ``SHIM_DISABLE=all`` (or no ``import shim`` at all) in a fresh interpreter: nothing is wrapped.
  This is the honest baseline for import time, load time and peak memory.
- ``shim.disabled()`` in the same process: the wrappers stay, inert (wrapt's ``enabled=``
  short-circuit). The in-process comparisons interleave on and off on identical models.

Every measurement alternates on and off (ABBA order) and reports medians; a ratio is the median of
the per-round ratios, with their interquartile range as the noise. Shim layers are found from the
registry, so a new patch shows up in the per-wrapper table without changes here.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = False  # set by main(): a quick run has too few rounds to judge a target
HEAVY = ("torch", "transformers", "trl", "peft", "accelerate", "numpy")
TARGETS = {"import": 1.01, "load": 1.02, "step": 1.01, "memory": 1.01, "cycle": 1.10}
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore",
}


# -- settings ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats and small models (CI smoke run)")
    parser.add_argument("--rounds", type=int, help="on/off rounds per measurement (default 12, quick 2)")
    parser.add_argument("--cpu", default="last", help="CPU to pin to: an index, 'last' (default) or 'none'")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.sizes = {
        # from_pretrained: a Llama with 9 tensors per layer (+3); 112 layers = 1011 tensors.
        "load_layers": 12 if quick else 112,
        # the training step
        "step_config": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=128,
        )
        if quick
        else dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=256,
        ),
        "batch": (2, 32) if quick else (4, 64),
        # trl's disable/enable cycle is also measured on a deep model: its cost grows with the modules
        "deep_layers": 8 if quick else 32,
    }
    args.rounds = args.rounds or (2 if quick else 12)
    args.import_rounds = 2 if quick else max(args.rounds, 12)
    args.worker_rounds = 1 if quick else 6
    args.steps_per_block = 3 if quick else 8
    args.cycles_per_block = 5 if quick else 100  # ~50 ms blocks: long enough to shrug off scheduler noise
    args.replay_seconds = 0.01 if quick else 0.1
    return args


def pin(cpu: str) -> str:
    os.environ.update(QUIET_ENV)
    if cpu == "none" or not hasattr(os, "sched_setaffinity"):
        return "not pinned"
    available = sorted(os.sched_getaffinity(0))
    chosen = available[-1] if cpu == "last" else int(cpu)
    os.sched_setaffinity(0, {chosen})  # inherited by every subprocess
    return f"pinned to CPU {chosen} of {len(available)}"


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(QUIET_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


# -- statistics ---------------------------------------------------------------------------------------


def quartiles(values):
    values = sorted(values)
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def compare(on: list, off: list) -> dict:
    """Medians of both and the median of the per-round ratios, with their quartiles.

    Samples are numbers, or ``[cpu seconds, wall seconds]`` pairs: then the CPU time is compared
    and the wall-clock ratio is added.
    """
    if on and isinstance(on[0], (list, tuple)):
        result = compare([cpu for cpu, _ in on], [cpu for cpu, _ in off])
        result["wall_ratio"] = statistics.median(a / b for (_, a), (_, b) in zip(on, off))
        return result
    ratios = [a / b for a, b in zip(on, off) if b > 0]
    r25, ratio, r75 = quartiles(ratios)
    spread = lambda v: (quartiles(v)[2] - quartiles(v)[0]) / statistics.median(v) if statistics.median(v) else 0.0
    return {
        "on": statistics.median(on),
        "off": statistics.median(off),
        "ratio": ratio,
        "ratio_q25": r25,
        "ratio_q75": r75,
        "noise": max(spread(on), spread(off)),  # relative IQR of the noisier side
        "n": len(ratios),
    }


class Clock:
    """CPU time of this process (robust against other load on a shared machine) and wall time."""

    def __enter__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.sample = [time.process_time() - self.cpu, time.perf_counter() - self.wall]


def interleave(run_on, run_off, rounds: int) -> tuple[list, list]:
    """ABBA: on/off order alternates each round so that a drift in machine load cancels out."""
    on, off = [], []
    for index in range(rounds):
        order = ((run_on, on), (run_off, off)) if index % 2 == 0 else ((run_off, off), (run_on, on))
        for run, into in order:
            into.append(run())
    return on, off


# -- memory -----------------------------------------------------------------------------------------


def _status_kib(field: str):
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_mib() -> float:
    kib = _status_kib("VmRSS")
    if kib is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return kib / 1024


def reset_peak() -> bool:
    """Return freed heap to the OS and restart the peak-RSS counter (Linux >= 4.0)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_mib() -> float:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return kib / 1024


# -- the workloads ------------------------------------------------------------------------------------


def quiet_libraries() -> None:
    warnings.simplefilter("ignore")
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def save_load_model(directory: str, layers: int) -> int:
    import torch
    import transformers

    from shim.tinymodels import tiny_llama_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers))
    model.save_pretrained(directory)
    return len(model.state_dict())


def load(directory: str):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(directory)


def training_model(config: dict, reentrant: bool, seed: int = 0):
    """A tiny Llama with checkpointing on, in train mode, with AdamW, and one batch."""
    import torch
    import transformers

    from shim.patches._checkpointing import enable
    from shim.tinymodels import tiny_llama_config

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config(**config))
    enable(model, {"use_reentrant": reentrant})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def batch(config: dict, shape: tuple):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, config["vocab_size"], shape, generator=generator)


def train_step(model, optimizer, input_ids) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()


def trl_cycle(model, accelerator, kwargs) -> None:
    """What trl does around every generation step (GRPO, RLOO, online DPO, ...)."""
    import trl.models.utils

    with trl.models.utils.unwrap_model_for_generation(
        model, accelerator, gather_deepspeed3_params=True, gradient_checkpointing_kwargs=kwargs
    ):
        pass


def trl_reference_cycle(model, kwargs) -> None:
    """What trl's DPO/KTO/GRPO do around every reference-model forward."""
    import trl.models.utils

    with trl.models.utils.disable_gradient_checkpointing(model, kwargs):
        pass


# -- fresh interpreters -------------------------------------------------------------------------------


def run_child(argv: list, env: dict, timeout: int = 600) -> dict:
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark subprocess failed ({result.returncode}): {argv}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def time_import(statement: str, before: str = "", env: dict | None = None) -> dict:
    """Seconds to run ``statement`` in a fresh interpreter (after ``before``, untimed), and its modules."""
    code = (
        f"import sys, time\nfirst = time.process_time()\n{before}\nfirst = time.process_time() - first\n"
        "loaded = set(sys.modules)\n"
        f"cpu, wall = time.process_time(), time.perf_counter()\n{statement}\n"
        "elapsed = [time.process_time() - cpu, time.perf_counter() - wall]\n"
        "import json\nshim = sys.modules.get('shim')\n"
        "print('RESULT ' + json.dumps({'s': elapsed, 'before': first, 'new': sorted(set(sys.modules) - loaded),"
        " 'shim_file': getattr(shim, '__file__', None)}))\n"
    )
    return run_child([sys.executable, "-c", code], env or child_env())


def measure_imports(args, log) -> dict:
    out = {}
    # Bytecode caches warm, as after any first run (this environment may set PYTHONDONTWRITEBYTECODE).
    import compileall

    for package in ("shim", "patches"):  # the repository folders (patches/ is installed as shim.patches)
        compileall.compile_dir(str(ROOT / package), quiet=1)
    time_import("import shim, transformers")

    log("import shim alone")
    on, off = interleave(
        lambda: time_import("import shim"),
        lambda: time_import("import shim", env=child_env(SHIM_DISABLE="all")),
        args.import_rounds,
    )
    out["shim"] = compare([r["s"] for r in on], [r["s"] for r in off])
    new = on[0]["new"]
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    out["shim_modules"] = {
        "count": len(new),
        "third_party": sorted({m.split(".")[0] for m in new} - set(stdlib) - {"shim", "patches"}),
        "heavy": sorted(m for m in HEAVY if m in new),
        "early": sorted(m for m in new if m.startswith(("shim.patches.", "wrapt", "packaging.specifiers"))),
        "file": os.path.relpath(on[0]["shim_file"], ROOT) if on[0]["shim_file"] else None,
    }

    log("import shim, transformers")
    with_shim, without, disabled = [], [], []
    for index in range(args.import_rounds):
        runs = [
            (lambda: time_import("import transformers"), without),
            (lambda: time_import("import shim, transformers"), with_shim),
            (lambda: time_import("import shim, transformers", env=child_env(SHIM_DISABLE="all")), disabled),
        ]
        for run, into in runs if index % 2 == 0 else reversed(runs):
            into.append(run()["s"])
    out["transformers"] = compare(with_shim, without)
    out["transformers_disabled"] = compare(disabled, without)

    # The same cost measured directly, far less noisy than a difference of two import times: the
    # CPU time of ``import shim`` in an interpreter that has already imported the rest.
    log("import shim after transformers (marginal cost)")
    runs = [time_import("import shim", before="import transformers") for _ in range(args.import_rounds)]
    out["marginal_transformers"] = marginal(runs)
    # After the model classes are imported every transformers target is there: activation applies
    # the patches on the spot (gate, probe, wrap), so this is the whole cost of applying them.
    before = "import warnings; warnings.simplefilter('ignore')\nfrom transformers import LlamaForCausalLM"
    runs = [time_import("import shim", before=before) for _ in range(max(2, args.import_rounds // 3))]
    out["marginal_applied"] = marginal(runs)
    return out


def marginal(runs: list) -> dict:
    """CPU seconds of the timed statement, of what ran before it, and the ratio they imply."""
    cost = statistics.median(r["s"][0] for r in runs)
    base = statistics.median(r["before"] for r in runs)
    return {"cost": quartiles([r["s"][0] for r in runs]), "base": base, "ratio": (base + cost) / base}


def measure_workers(args, directory: str, log) -> dict:
    """Load and training step in fresh interpreters: shim on vs SHIM_DISABLE=all (nothing wrapped)."""
    spec = json.dumps(
        {
            "directory": directory,
            "sizes": args.sizes,
            "loads": max(2, args.rounds // 2),
            "steps": args.steps_per_block * 5,
        }
    )
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", spec]
    on, off = interleave(
        lambda: run_child(argv, child_env()),
        lambda: run_child(argv, child_env(SHIM_DISABLE="all")),
        args.worker_rounds,
    )
    out = {}
    for key in on[0]:
        if key not in ("applied", "waiting") and key in off[0]:
            out[key] = compare([r[key] for r in on], [r[key] for r in off])
    out["applied_on"] = on[0]["applied"]
    out["applied_off"] = off[0]["applied"]
    out["waiting"] = on[0]["waiting"]
    return out


def worker(spec_json: str) -> None:
    """One fresh interpreter: ``import shim`` first (on, or off through SHIM_DISABLE), then the workloads."""
    spec = json.loads(spec_json)
    import shim  # noqa: F401  - SHIM_DISABLE decides whether anything is wrapped

    quiet_libraries()
    sizes = spec["sizes"]
    result = {}
    tracked = reset_peak()

    # The phase is the load itself: the model classes are imported first. That import is where the
    # shim's patches apply (their modules, wrapt and packaging are imported lazily, ~2 MiB), which
    # the whole-process peak below counts.
    from transformers import LlamaForCausalLM  # noqa: F401

    start = rss_mib()
    model = load(spec["directory"])  # cold: the first load of the process
    result["load_peak_mib"] = peak_mib()
    if tracked:
        result["load_peak_delta_mib"] = peak_mib() - start
    del model
    times = []
    for _ in range(spec["loads"]):
        gc.collect()
        with Clock() as clock:
            load(spec["directory"])
        times.append(clock.sample)
    result["load_s"] = median_sample(times)

    for reentrant in (True, False):
        name = "reentrant" if reentrant else "non_reentrant"
        input_ids = batch(sizes["step_config"], sizes["batch"])
        reset_peak()
        start = rss_mib()
        model, optimizer = training_model(sizes["step_config"], reentrant)
        train_step(model, optimizer, input_ids)  # first step: optimizer state, autograd buffers
        train_step(model, optimizer, input_ids)
        result[f"step_{name}_peak_mib"] = peak_mib()
        if tracked:
            result[f"step_{name}_peak_delta_mib"] = peak_mib() - start
        times = []
        for _ in range(spec["steps"]):
            with Clock() as clock:
                train_step(model, optimizer, input_ids)
            times.append(clock.sample)
        result[f"step_{name}_s"] = median_sample(times)
        del model, optimizer
    result["applied"] = sum(s.state == "applied" for s in shim.status())
    result["waiting"] = [s.name for s in shim.status() if s.state == "pending"]
    print("RESULT " + json.dumps(result))


# -- the same process: shim on vs shim.disabled() ---------------------------------------------------------


def median_sample(samples: list) -> list:
    return [statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)]


def timed(function, per: int = 1) -> list:
    gc.collect()
    with Clock() as clock:
        function()
    return [clock.sample[0] / per, clock.sample[1] / per]


def measure_in_process(args, directory: str, log) -> dict:
    import accelerate

    import shim

    out = {}
    log("from_pretrained in process")
    load(directory)  # warm caches
    on, off = interleave(
        lambda: timed(lambda: load(directory)), lambda: timed(lambda: off_(lambda: load(directory))), args.rounds
    )
    out["load"] = compare(on, off)

    config, shape = args.sizes["step_config"], args.sizes["batch"]
    input_ids = batch(config, shape)
    for reentrant in (True, False):
        name = "reentrant" if reentrant else "non_reentrant"
        log(f"training step ({name}) in process")
        model_on, opt_on = training_model(config, reentrant)
        with shim.disabled():
            model_off, opt_off = training_model(config, reentrant)
        n = args.steps_per_block
        block_on = lambda: [train_step(model_on, opt_on, input_ids) for _ in range(n)]
        block_off = lambda: off_(lambda: [train_step(model_off, opt_off, input_ids) for _ in range(n)])
        block_on(), block_off()  # warm-up: optimizer state
        on, off = interleave(lambda: timed(block_on, n), lambda: timed(block_off, n), args.rounds * 2)
        out[f"step_{name}"] = compare(on, off)
        del model_on, model_off, opt_on, opt_off

    log("disable/enable cycles in process")
    accelerator = accelerate.Accelerator(cpu=True)
    kwargs = {"use_reentrant": False}
    n = args.cycles_per_block
    deep = dict(config, num_hidden_layers=args.sizes["deep_layers"])
    for suffix, model_config in (("", config), ("_deep", deep)):
        model_on, _ = training_model(model_config, False)
        with shim.disabled():
            model_off, _ = training_model(model_config, False)
        for key, cycle in (
            ("cycle_unwrap", lambda model: trl_cycle(model, accelerator, kwargs)),
            ("cycle_disable_gc", lambda model: trl_reference_cycle(model, kwargs)),
        ):
            block_on = lambda: [cycle(model_on) for _ in range(n)]
            block_off = lambda: off_(lambda: [cycle(model_off) for _ in range(n)])
            block_on(), block_off()
            on, off = interleave(lambda: timed(block_on, n), lambda: timed(block_off, n), args.rounds * 2)
            out[key + suffix] = compare(on, off)
        del model_on, model_off
    return out


def off_(function):
    import shim

    with shim.disabled():
        return function()


# -- per-wrapper cost -------------------------------------------------------------------------------------


def shim_layers() -> list[dict]:
    """Every shim layer in place right now, found through the registry (nothing listed by hand)."""
    import wrapt

    import shim
    from shim.wrapping import find_shim_wrapper

    layers = []
    for name in shim.registry.names:
        for target in shim.registry.patch(name).targets:
            module = sys.modules.get(target.module)
            if module is None:
                continue
            try:
                parent, attribute, outer = wrapt.resolve_path(module, target.path)
            except Exception:
                continue
            handle = find_shim_wrapper(outer, name)
            if handle is not None:
                layers.append(
                    {
                        "patch": name,
                        "spec": target.spec,
                        "parent": parent,
                        "attribute": attribute,
                        "handle": handle,
                        "inner": handle.__wrapped__,
                        "module": module,
                        "path": target.path,
                    }
                )
    return layers


class Recorder:
    """A temporary outermost wrapt layer on each wrapped attribute: counts calls, keeps a sample."""

    def __init__(self, layers):
        import wrapt

        self.counts: dict = {}
        self.calls: dict = {}
        self.workload = ""
        self._installed = []
        for spec in dict.fromkeys(layer["spec"] for layer in layers):
            layer = next(layer for layer in layers if layer["spec"] == spec)

            def record(wrapped, instance, args, kwargs, spec=spec):
                if self.workload:
                    key = (spec, self.workload)
                    self.counts[key] = self.counts.get(key, 0) + 1
                    kept = self.calls.setdefault(spec, [])
                    if len(kept) < 2000:
                        kept.append((instance, args, dict(kwargs)))
                return wrapped(*args, **kwargs)

            factory = lambda original, r=record: wrapt.FunctionWrapper(original, r)
            handle = wrapt.wrap_object(layer["module"], layer["path"], factory)
            self._installed.append((layer["module"], layer["path"], handle))

    def __call__(self, workload: str):
        self.workload = workload
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.workload = ""

    def remove(self):
        import wrapt

        for module, path, handle in reversed(self._installed):
            wrapt.unwrap_object(module, path, handle)


def per_call_ns(function, seconds: float) -> float:
    timer = timeit.Timer(function)
    number, _ = timer.autorange()
    number = max(1, int(number * seconds / 0.2))
    return min(timer.repeat(repeat=5, number=number)) / number * 1e9


def measure_wrappers(args, directory: str, log) -> dict:
    """Count calls through each shim layer in each workload, then time each layer by replaying them."""
    import accelerate

    import shim

    layers = shim_layers()
    recorder = Recorder(layers)
    config, shape = args.sizes["step_config"], args.sizes["batch"]
    input_ids = batch(config, shape)
    accelerator = accelerate.Accelerator(cpu=True)
    try:
        with recorder("load"):
            load(directory)
        for reentrant in (True, False):
            model, optimizer = training_model(config, reentrant)
            train_step(model, optimizer, input_ids)
            with recorder("step (reentrant)" if reentrant else "step (non-reentrant)"):
                train_step(model, optimizer, input_ids)
        with recorder("trl unwrap cycle"):
            trl_cycle(model, accelerator, {"use_reentrant": False})
        with recorder("trl disable_gc cycle"):
            trl_reference_cycle(model, {"use_reentrant": False})
        calls = dict(recorder.calls)
        counts = dict(recorder.counts)
    finally:
        recorder.remove()

    log("per-wrapper replays")
    rows = []
    for layer in layers:
        row = {
            "patch": layer["patch"],
            "target": layer["spec"],
            "calls": {w: c for (s, w), c in counts.items() if s == layer["spec"]},
        }
        if layer["spec"] not in calls:
            row["replay"] = "not called by these workloads"
            rows.append(row)
            continue
        recorded = calls[layer["spec"]]
        sample = recorded[:: max(1, len(recorded) // 50)]  # evenly spaced: short and long paths alike

        def bind(function, instance):
            if instance is not None and isinstance(layer["parent"], type) and hasattr(function, "__get__"):
                return function.__get__(instance, type(instance))
            return function

        def replay(function):  # binding is part of the call, as in ``model.method(...)``
            return lambda: [bind(function, instance)(*a, **k) for instance, a, k in sample]

        try:
            on = per_call_ns(replay(layer["handle"]), args.replay_seconds) / len(sample)
            with shim.disabled(layer["patch"]):
                inert = per_call_ns(replay(layer["handle"]), args.replay_seconds) / len(sample)
            bare = per_call_ns(replay(layer["inner"]), args.replay_seconds) / len(sample)
        except Exception as exc:  # a call that cannot be repeated out of its context
            row["replay"] = f"replay failed: {exc!r}"[:120]
        else:
            row.update(on_ns=on, inert_ns=inert, bare_ns=bare)
        rows.append(row)
    return {"rows": rows}


def measure_effects(args, counted: dict) -> dict:
    """What one effects-ledger record costs (it runs only on the branch where a patch changed
    something: a call passed through never reaches it), beside what the workloads counted."""
    from shim import effects

    record_ns = per_call_ns(lambda: effects.record("benchmark-probe", "probe %d", 1), args.replay_seconds)
    return {"counted": counted, "record_ns": record_ns}


def measure_engine(args) -> dict:
    """The raw cost of one shim layer (pass-through wrapper) on a module function and a method."""
    from shim import wrapping

    module = types.ModuleType("shim_overhead_fake")

    def function(a, b=None):
        return a

    class Class:
        def method(self, a, b=None):
            return a

    module.function, module.Class = function, Class
    instance = Class()
    bare_function = per_call_ns(lambda: module.function(1, b=2), args.replay_seconds)
    bare_method = per_call_ns(lambda: instance.method(1, b=2), args.replay_seconds)
    switch = wrapping.Switch()
    passthrough = lambda wrapped, instance_, a, k: wrapped(*a, **k)
    wrapping.install(module, "function", "bench", passthrough, switch)
    wrapping.install(module, "Class.method", "bench", passthrough, switch)
    on_function = per_call_ns(lambda: module.function(1, b=2), args.replay_seconds)
    on_method = per_call_ns(lambda: instance.method(1, b=2), args.replay_seconds)
    switch.disabled = True
    switch.update()
    off_function = per_call_ns(lambda: module.function(1, b=2), args.replay_seconds)
    off_method = per_call_ns(lambda: instance.method(1, b=2), args.replay_seconds)
    return {
        "module function": (bare_function, on_function, off_function),
        "method via instance": (bare_method, on_method, off_method),
    }


REENTRANT = ("reentrant-keyword-grads", "reentrant-frozen-input-grads")


def measure_layer_calls(args) -> dict:
    """ns per ``GradientCheckpointingLayer`` call that neither reentrant patch diverts, on a layer
    whose ``forward`` does nothing and whose checkpoint function only calls it: the cost of the two
    stacked layers' decision itself, on the calls a training step makes (the per-wrapper rows above
    time whole decoder layers, whose own noise hides it)."""
    import functools

    import torch
    import transformers.modeling_layers as modeling_layers

    import shim

    class Light(modeling_layers.GradientCheckpointingLayer):
        def forward(self, hidden_states, attention_mask=None):
            return hidden_states

    def run(function, *inputs, **options):  # a checkpoint function that only calls the layer
        return function(*inputs)

    light = Light()
    light.train()
    hidden = torch.zeros(1, 1, 4, requires_grad=True)
    mask = torch.zeros(1, 1)
    cases = {
        "no checkpointing": (False, None, lambda: light(hidden, attention_mask=mask)),
        "reentrant, positional input requires grad": (
            True,
            functools.partial(run, use_reentrant=True),
            lambda: light(hidden, attention_mask=mask),
        ),
        "non-reentrant, keyword input requires grad": (
            True,
            functools.partial(run, use_reentrant=False),
            lambda: light(hidden_states=hidden, attention_mask=mask),
        ),
    }
    timings: dict = {}

    def time_cases(key: str) -> None:
        for label, (checkpointing, function, call) in cases.items():
            light.gradient_checkpointing = checkpointing
            light._gradient_checkpointing_func = function
            timings.setdefault(label, {})[key] = per_call_ns(call, args.replay_seconds)

    time_cases("on")
    for name in REENTRANT:
        with shim.disabled(name):
            time_cases(name)
    with shim.disabled(*REENTRANT):
        time_cases("inert")
    shim.deactivate()  # the layers removed: upstream's call
    try:
        time_cases("bare")
    finally:
        shim.activate()
    return timings


# -- report -----------------------------------------------------------------------------------------------


def table(rows, headers, left=(0,)) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(
        c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    ).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def verdict(result: dict, kind: str) -> str:
    """``holds``; ``noise`` when the median misses but the lower quartile of the ratios does not."""
    if kind == "cross":
        return "(*)"
    target = TARGETS[kind]
    if QUICK:
        return f"<= {target:.2f} (quick: not judged)"
    state = "holds" if result["ratio"] <= target else "noise" if result["ratio_q25"] <= target else "MISSED"
    return f"<= {target:.2f} {state}"


def number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def comparison_row(label, result, scale, kind=None):
    return [
        label,
        number(result["on"] * scale),
        number(result["off"] * scale),
        f"{result['ratio']:.3f}",
        f"{result['ratio_q25']:.3f}-{result['ratio_q75']:.3f}",
        f"{result['noise'] * 100:.0f}%",
        f"{result['wall_ratio']:.3f}" if "wall_ratio" in result else "",
        str(result["n"]),
        verdict(result, kind) if kind else "",
    ]


HEADERS = ["measurement", "on", "off", "ratio", "ratio IQR", "noise", "wall ratio", "n", "target"]


def report(args, info, imports, workers, in_process, wrappers, engine, layer_calls, ledger) -> str:
    out = []
    out.append(f"hf-train-shim overhead ({'quick' if args.quick else 'full'} run): shim on / shim off, same run")
    out.append(info)
    out.append(
        "times are CPU time of the measuring process (time.process_time: robust against other load on a "
        "shared machine; the work is single-threaded); 'wall ratio' is the same with wall-clock time"
    )
    out.append(
        "ratio = median of per-round on/off ratios (rounds alternate ABBA); noise = relative IQR of the noisier side"
    )
    out.append("")

    m = imports["shim_modules"]
    out.append("1-2. Import, fresh interpreters, bytecode cached (ms); off = SHIM_DISABLE=all, or no shim at all")
    rows = [
        comparison_row("import shim (off: SHIM_DISABLE=all)", imports["shim"], 1e3),
        comparison_row("import shim, transformers (off: import transformers)", imports["transformers"], 1e3, "import"),
        comparison_row("  SHIM_DISABLE=all import shim, transformers", imports["transformers_disabled"], 1e3),
    ]
    out.append(table(rows, HEADERS))
    for key, label, kind in (
        ("marginal_transformers", "import shim after import transformers (patches wait)", "import"),
        ("marginal_applied", "import shim after from transformers import LlamaForCausalLM (patches applied)", None),
    ):
        q = imports[key]["cost"]
        out.append(
            f"{label}: {q[1] * 1e3:.1f} ms CPU (IQR {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}) on top of "
            f"{imports[key]['base'] * 1e3:.0f} ms: ratio {imports[key]['ratio']:.3f}"
            + (
                f", target {verdict({'ratio': imports[key]['ratio'], 'ratio_q25': imports[key]['ratio']}, kind)}"
                if kind
                else ""
            )
        )
    out.append(
        f"import shim loads {m['count']} modules; outside the standard library: "
        f"{', '.join(m['third_party']) or 'none'}; torch/transformers/trl/peft/accelerate/numpy: "
        f"{', '.join(m['heavy']) or 'none'} (shim from {m['file']})"
    )
    out.append(
        f"import shim imports a patch module, wrapt or packaging.specifiers before a target is imported: "
        f"{', '.join(m['early']) or 'none'}"
    )
    out.append("")

    out.append(
        f"3-4, 6. Fresh interpreters, shim on vs SHIM_DISABLE=all (nothing wrapped): "
        f"{workers['applied_on']} patches applied vs {workers['applied_off']}"
        + (
            f" ({', '.join(workers['waiting'])} waits for a module these workloads do not import)"
            if workers["waiting"]
            else ""
        )
        + "; time in ms, memory in MiB"
    )
    labels = {
        "load_s": ("from_pretrained, warm", 1e3, "load"),
        "load_peak_mib": ("  peak RSS of the process, first load", 1, "memory"),
        "load_peak_delta_mib": ("  peak RSS above start of load", 1, "memory"),
        "step_reentrant_s": ("training step, reentrant", 1e3, "cross"),
        "step_reentrant_peak_mib": ("  peak RSS, first two steps", 1, "memory"),
        "step_reentrant_peak_delta_mib": ("  peak RSS above start", 1, "memory"),
        "step_non_reentrant_s": ("training step, non-reentrant", 1e3, "cross"),
        "step_non_reentrant_peak_mib": ("  peak RSS, first two steps", 1, "memory"),
        "step_non_reentrant_peak_delta_mib": ("  peak RSS above start", 1, "memory"),
    }
    rows = [
        comparison_row(label, workers[key], scale, kind)
        for key, (label, scale, kind) in labels.items()
        if key in workers
    ]
    out.append(table(rows, HEADERS))
    out.append(
        "(*) a step takes milliseconds and its time scatters by several % between interpreters (memory "
        "layout) whatever the shim does: the step target is judged in the same process, below"
    )
    out.append(
        "torch allocator peak: not applicable on CPU (the CPU allocator keeps no statistics); RSS is the measure"
    )
    out.append("")

    out.append("3-5. Same process, shim on vs shim.disabled() (wrappers in place, inert), identical models; ms")
    layers, deep = args.sizes["step_config"]["num_hidden_layers"], args.sizes["deep_layers"]
    labels = {
        "load": (f"from_pretrained ({info_tensors(args)})", "load"),
        "step_reentrant": ("training step, reentrant", "step"),
        "step_non_reentrant": ("training step, non-reentrant", "step"),
        "cycle_unwrap": (f"trl unwrap_model_for_generation cycle, {layers} layers", "cycle"),
        "cycle_disable_gc": (f"trl disable_gradient_checkpointing cycle, {layers} layers", "cycle"),
        "cycle_unwrap_deep": (f"trl unwrap_model_for_generation cycle, {deep} layers", "cycle"),
        "cycle_disable_gc_deep": (f"trl disable_gradient_checkpointing cycle, {deep} layers", "cycle"),
    }
    rows = [comparison_row(label, in_process[key], 1e3, kind) for key, (label, kind) in labels.items()]
    out.append(table(rows, HEADERS))
    out.append("")

    out.append(
        "Per-wrapper cost, ns/call (timeit, best of 5, replaying a call recorded in the workloads); "
        "cost = through the layer - around it"
    )
    rows = []
    for row in wrappers["rows"]:
        extra = lambda c: f" ({c * (row['on_ns'] - row['bare_ns']) / 1e3:+.1f} us)" if "on_ns" in row else ""
        calls = ", ".join(f"{w} {c}{extra(c)}" for w, c in row["calls"].items()) or "-"
        if "on_ns" in row:
            rows.append(
                [
                    row["patch"],
                    row["target"],
                    f"{row['bare_ns']:.0f}",
                    f"{row['on_ns'] - row['bare_ns']:+.0f}",
                    f"{row['inert_ns'] - row['bare_ns']:+.0f}",
                    calls,
                ]
            )
        else:
            rows.append([row["patch"], row["target"], "", "", "", f"{calls}: {row['replay']}"])
    headers = ["patch", "target", "call ns", "on +ns", "inert +ns", "calls per workload (cost)"]
    out.append(table(rows, headers, left=(0, 1, 5)))
    out.append(
        "(a target missing here is not applied on this version; 'step' workloads absent from 'calls' mean "
        "no shim layer runs during a training step)"
    )
    rows = [
        [kind, f"{bare:.0f}", f"{on - bare:+.0f}", f"{off - bare:+.0f}"] for kind, (bare, on, off) in engine.items()
    ]
    out.append("One shim layer with a pass-through wrapper (the engine's floor):")
    out.append(table(rows, ["call", "bare ns", "on +ns", "inert +ns"]))
    out.append(
        "GradientCheckpointingLayer calls that no reentrant patch diverts (a layer whose forward does nothing): "
        "ns per call; 'on' both layers acting, '<patch> +ns' what that patch's decision adds, 'inert' both "
        "switched off"
    )
    rows = [
        [
            label,
            f"{t['bare']:.0f}",
            f"{t['on'] - t['bare']:+.0f}",
            *(f"{t['on'] - t[name]:+.0f}" for name in REENTRANT),
            f"{t['inert'] - t['bare']:+.0f}",
        ]
        for label, t in layer_calls.items()
    ]
    out.append(table(rows, ["layer call", "bare ns", "on +ns", *(f"{n} +ns" for n in REENTRANT), "inert +ns"]))
    counted = ", ".join(f"{name} {count}" for name, count in ledger["counted"].items())
    out.append(
        f"Effects ledger: one record costs {ledger['record_ns']:.0f} ns and runs only on a call that changed "
        f"something (the per-wrapper rows above replay pass-through calls, which never reach it); "
        f"effects counted by the in-process workloads (load, steps, trl cycles): {counted}"
    )
    timings = [
        r
        for group in (imports, workers, in_process)
        for r in group.values()
        if isinstance(r, dict) and "wall_ratio" in r
    ]
    noise = sorted(r["noise"] for r in timings)
    out.append("")
    out.append(
        f"Noise: relative IQR of the timings {noise[0] * 100:.0f}-{noise[-1] * 100:.0f}% "
        f"(median {statistics.median(noise) * 100:.0f}%); cross-process rows also carry the scatter between "
        "interpreters (memory layout), which more steps per process do not remove"
    )
    return "\n".join(out)


def info_tensors(args) -> str:
    return f"{9 * args.sizes['load_layers'] + 3} tensors"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    global QUICK
    QUICK = args.quick
    pinned = pin(args.cpu)
    sys.path.insert(0, str(ROOT))
    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    log = lambda message: print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    log("imports in fresh interpreters")
    imports = measure_imports(args, log)

    import shim  # the user's first line, before torch and transformers

    quiet_libraries()
    import torch
    import transformers
    import trl
    import wrapt

    with tempfile.TemporaryDirectory() as directory:
        tensors = save_load_model(directory, args.sizes["load_layers"])
        log(f"load and training step in fresh interpreters ({tensors} tensors)")
        workers = measure_workers(args, directory, log)
        in_process = measure_in_process(args, directory, log)
        counted = {record.name: record.effects for record in shim.status()}  # before the replays add more
        wrappers = measure_wrappers(args, directory, log)
    engine = measure_engine(args)
    layer_calls = measure_layer_calls(args)
    ledger = measure_effects(args, counted)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    applied = [s.name for s in shim.status() if s.state == "applied"]
    info = (
        f"python {platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__} | "
        f"trl {trl.__version__} | wrapt {wrapt.__version__} | {pinned}, 1 torch thread | load average "
        f"{load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs | {time.perf_counter() - started:.0f} s\n"
        f"patches applied ({len(applied)}): {', '.join(applied)}"
    )
    text = report(args, info, imports, workers, in_process, wrappers, engine, layer_calls, ledger)
    print(text)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "imports": imports,
                    "workers": workers,
                    "in_process": in_process,
                    "wrappers": wrappers,
                    "engine": engine,
                    "layer_calls": layer_calls,
                    "effects": ledger,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
