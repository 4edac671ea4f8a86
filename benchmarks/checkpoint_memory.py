"""What activation checkpointing saves, with the shim off and on, in one run on one device (run by
hand, not a test).

Users turn checkpointing on for memory, so a fix that keeps tensors alive longer (keyword tensors
lifted as checkpoint inputs, a frozen-input anchor, a frozen tower kept out of backward) could eat the
saving silently. This benchmark measures one training step (forward, loss, backward) of each case
with the shim switched off (``shim.disabled()``: upstream's behaviour, the wrappers inert) and on,
on the same model in the same process, round after round:

- **held for backward**: the memory allocated after the loss minus before the forward, what autograd
  keeps for backward. On CUDA ``torch.cuda.memory_allocated()``; on a CPU glibc's own count,
  ``mallinfo2()`` (bytes in use on the heap plus mmapped bytes), which repeats to within a few KB
  where the resident set (``VmHWM``) moves by about 10 % between identical runs. glibc's dynamic mmap
  threshold would move big blocks between the two counts, so the script re-executes itself with
  ``MALLOC_MMAP_THRESHOLD_`` fixed, before anything is measured;
- **peak in backward**: the most allocated during ``backward()``, the recomputation included, above
  the start of the step: ``torch.cuda.max_memory_allocated()``; on a CPU the heap count read after
  every operator (a ``TorchDispatchMode``), so the peak at operator granularity;
- **step peak**: the most allocated during the whole step above its start: the CUDA peak again, or on
  a CPU the resident set's high-water mark (``VmHWM``, restarted through ``/proc/self/clear_refs``),
  printed for comparison, too noisy to judge 1 % by;
- **step time**: the median of ``--steps`` plain steps per round (no meter attached).

The cases (``CASES``): a Llama (8 layers, hidden 256, sequence 512, batch 2 by default) without
checkpointing, non-reentrant, reentrant; reentrant with the decoder layers called with
``hidden_states=`` by keyword (``reentrant-keyword-grads``; upstream drops the layers' gradients)
beside the positional call; driven with ``inputs_embeds`` from frozen embeddings, layer 0 frozen
(``reentrant-frozen-input-grads``; upstream drops them too), reentrant and non-reentrant; the Llama
with PEFT LoRA adapters, reentrant and non-reentrant; and a Qwen2-VL whose vision tower is frozen
(``frozen-tower-input-grads``; upstream runs backward through the tower for nothing). Each step's
gradients are checked against the same model's step without checkpointing, shim off and on, first.

The verdict: checkpointing's **saving** is what a case holds for backward less what the same model
holds without checkpointing. Where upstream's run is correct, the shim must keep its saving within 1 %
of upstream's (``saving on >= 0.99 x saving off``); where upstream's run is wrong (it saves memory by
dropping gradients), the shim's saving is judged against the upstream run that is right for the same
model (the positional call, non-reentrant checkpointing). The script prints the verdicts and exits 1
when one is missed or a gradient is wrong with the shim (``--json PATH`` writes every figure).

    python benchmarks/checkpoint_memory.py [--device cpu|cuda] [--quick] [--rounds 3] [--steps 2]
        [--layers 8] [--hidden 256] [--seq 512] [--batch 2] [--threads 1] [--json PATH]

``--quick``: a 2-layer Llama, sequence 64, a tiny tower and one round (seconds, for a smoke run; the
figures then mean little). MB are 10^6 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness import fixed_mmap_threshold, table, timed_step  # benchmarks/, first on sys.path for a script
from workloads import checkpointing_llama

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
WITHIN = 0.01  # the shim keeps checkpointing's saving within 1 % of upstream's
SIDES = ("off", "on")

# -- what a case is ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One checkpointing set-up of one model. ``call``: how the step drives the decoder layers
    (``positional``, ``keyword``: ``hidden_states=``, ``embeds``: from frozen embeddings, positional,
    ``model``: ``model(**inputs)``); ``baseline``: the same model and call without checkpointing, what
    the saving is measured from; ``reference``: for a case whose upstream run drops gradients, the
    upstream run that is right for the same model, whose saving the shim's must keep."""

    name: str
    family: str
    checkpointing: str  # "none", "reentrant", "non-reentrant", "default" (transformers' own kwargs)
    call: str
    baseline: str | None = None
    reference: str | None = None
    upstream_wrong: bool = False  # upstream is known to drop gradients here (checked, not assumed)


CASES = (
    Case("none", "llama", "none", "positional"),
    Case("non-reentrant", "llama", "non-reentrant", "positional", baseline="none"),
    Case("reentrant", "llama", "reentrant", "positional", baseline="none"),
    Case("keyword none", "llama", "none", "keyword"),
    Case("keyword reentrant", "llama", "reentrant", "keyword", "keyword none", "reentrant", upstream_wrong=True),
    Case("frozen-input none", "frozen-input", "none", "embeds"),
    Case("frozen-input non-reentrant", "frozen-input", "non-reentrant", "embeds", baseline="frozen-input none"),
    Case(
        "frozen-input reentrant",
        "frozen-input",
        "reentrant",
        "embeds",
        "frozen-input none",
        "frozen-input non-reentrant",
        upstream_wrong=True,
    ),
    Case("lora none", "lora", "none", "positional"),
    Case("lora non-reentrant", "lora", "non-reentrant", "positional", baseline="lora none"),
    Case("lora reentrant", "lora", "reentrant", "positional", baseline="lora none"),
    Case("frozen-tower none", "frozen-tower", "none", "model"),
    Case("frozen-tower default", "frozen-tower", "default", "model", baseline="frozen-tower none"),
)

# -- the verdict (pure: no torch) -------------------------------------------------------------------


def saving(held: dict, case: str, baseline: str, side: str) -> float:
    """Bytes checkpointing saves in ``case`` on ``side``: its baseline's held bytes less its own."""
    return held[baseline][side] - held[case][side]


def verdict(case: Case, held: dict, wrong: dict, judged: bool = True) -> dict:
    """The judgement of one checkpointed case from the median held bytes (``held[name][side]``) and the
    number of wrong gradients (``wrong[name][side]``): ``ok`` (``None`` when there is nothing to judge),
    the savings compared, and a line that says it (``judged``: false for a smoke run, whose line then
    says so)."""
    if case.baseline is None:
        return {"ok": None, "line": f"{case.name}: the baseline (no checkpointing)"}
    if wrong[case.name]["on"]:
        return {"ok": False, "line": f"{case.name}: {wrong[case.name]['on']} gradients wrong with the shim"}
    upstream_right = not wrong[case.name]["off"]
    against = case.name if upstream_right else case.reference
    if against is None:  # upstream wrong where no right upstream run is named: nothing to hold the shim to
        return {"ok": False, "line": f"{case.name}: upstream drops gradients and the case names no reference"}
    against_baseline = case.baseline if upstream_right else CASE[against].baseline
    upstream = saving(held, against, against_baseline, "off")
    shim = saving(held, case.name, case.baseline, "on")
    ok = shim >= (1 - WITHIN) * upstream  # a larger saving is no harm
    ratio = shim / upstream if upstream > 0 else None
    what = (
        "upstream's"
        if upstream_right
        else f"upstream's right run ({against}; its own drops {wrong[case.name]['off']} gradients)"
    )
    share = f"{ratio:.4f} of it" if ratio is not None else "upstream saves nothing"
    line = f"{case.name}: saves {shim / MB:.2f} MB with the shim, {upstream / MB:.2f} MB {what}: {share}, " + (
        f"{'holds' if ok else 'MISSED'} (>= {1 - WITHIN:.2f})" if judged else "not judged"
    )
    return {"ok": ok, "ratio": ratio, "saving_on": shim, "saving_off": upstream, "against": against, "line": line}


CASE = {case.name: case for case in CASES}

# -- reading memory ---------------------------------------------------------------------------------


class Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+): every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def in_use(info: Mallinfo2) -> int:
    """Bytes the program holds from malloc: allocated heap chunks (``uordblks``, every arena) and
    mmapped blocks (``hblkhd``, the large tensors under a fixed threshold)."""
    return info.uordblks + info.hblkhd


def mallinfo2() -> Callable[[], Mallinfo2] | None:
    """glibc's ``mallinfo2`` through ctypes, or ``None`` where there is none (musl, macOS, glibc < 2.33)."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = Mallinfo2
    function.argtypes = []
    return function


class HeapMeter:
    """A CPU's memory: glibc's count of bytes in use, its peak read after every operator."""

    what = "glibc mallinfo2() (heap in use + mmapped), MALLOC_MMAP_THRESHOLD_ fixed"

    def __init__(self) -> None:
        read = mallinfo2()
        if read is None:
            raise SystemExit("checkpoint_memory: no glibc mallinfo2() here (glibc 2.33+ on Linux is needed on a CPU)")
        self.read = read

    def now(self) -> int:
        return in_use(self.read())

    def peak_of(self, run: Callable[[], object]) -> int:
        """The most in use at any operator's end while ``run()`` runs (a dispatch mode sees every
        aten operator, the recomputation's too)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class Peak(TorchDispatchMode):
            peak = meter.now()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                Peak.peak = max(Peak.peak, meter.now())
                return out

        with Peak():
            run()
        return Peak.peak

    def step_peak(self, run: Callable[[], object]) -> float:
        """MB the resident set's high-water mark rises above the resident set while ``run()`` runs."""
        _, kib = timed_step(run)
        return kib * 1024 / MB

    def sync(self) -> None:
        pass


class CudaMeter:
    """A CUDA device's memory: torch's caching allocator's counts."""

    what = "torch.cuda.memory_allocated() / max_memory_allocated()"

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda
        self.before_reset = 0  # the peak a step had reached when backward's own count was restarted

    def sync(self) -> None:
        self.cuda.synchronize()

    def now(self) -> int:
        self.sync()
        return self.cuda.memory_allocated()

    def peak_of(self, run: Callable[[], object]) -> int:
        self.sync()
        self.before_reset = max(self.before_reset, self.cuda.max_memory_allocated())
        self.cuda.reset_peak_memory_stats()
        run()
        self.sync()
        return self.cuda.max_memory_allocated()

    def step_peak(self, run: Callable[[], object]) -> float:
        """MB the step's peak rises above its start: backward's peak, or the forward's before it."""
        start = self.now()
        self.cuda.reset_peak_memory_stats()
        self.before_reset = 0
        run()
        self.sync()
        return (max(self.before_reset, self.cuda.max_memory_allocated()) - start) / MB


# -- the models and their steps ---------------------------------------------------------------------


def build(family: str, options, device: str):
    """``(model, inputs)`` of a family, on ``device``, in training mode, seeded."""
    import torch

    from tests.tinymodels import lora_config, tiny_qwen2_vl, vision_tower

    torch.manual_seed(0)
    if family == "frozen-tower":
        model, inputs = tiny_qwen2_vl(options.tower_depth, options.tower_width, options.image)
        vision_tower(model).requires_grad_(False)  # the usual VLM set-up: the language model trains
        return model.to(device), {key: value.to(device) for key, value in inputs.items()}
    model = checkpointing_llama(options.layers, options.hidden, options.seq, use_cache=False)
    if family == "frozen-input":
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
    if family == "lora":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(r=8, lora_alpha=16))
    model.to(device).train()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (options.batch, options.seq), generator=generator).to(device)
    if family == "frozen-input":  # computed once, before any hook on the embeddings: inputs_embeds as users pass them
        with torch.no_grad():
            return model, {"input_ids": ids, "inputs_embeds": model.model.embed_tokens(ids)}
    return model, {"input_ids": ids}


def causal_lm(model):
    """The ``...ForCausalLM`` inside a PEFT model, or the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def loss_of(model, inputs, call: str):
    """The step's loss. ``model``: ``model(**inputs)``; otherwise the decoder's loop written out, as
    ``tests.steps.keyword_driven_grads`` does, so that the layers can be called positionally
    or with ``hidden_states=`` by keyword, from the embeddings or from ``inputs_embeds`` computed
    before (``embeds``: no hook on the embeddings reaches them, as with ``model(inputs_embeds=...)``)."""
    import torch

    if call == "model":
        return model(**inputs).loss
    ids = inputs["input_ids"]
    lm = causal_lm(model)
    inner = lm.model
    hidden = inputs["inputs_embeds"] if call == "embeds" else inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    embeddings = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        if call == "keyword":
            out = layer(hidden_states=hidden, position_ids=positions, position_embeddings=embeddings)
        else:
            out = layer(hidden, position_ids=positions, position_embeddings=embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    logits = lm.lm_head(inner.norm(hidden))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def configure(model, checkpointing: str) -> None:
    from tests.steps import enable_checkpointing

    if checkpointing == "none":
        if model.is_gradient_checkpointing:
            model.gradient_checkpointing_disable()
    else:
        kwargs = None if checkpointing == "default" else {"use_reentrant": checkpointing == "reentrant"}
        enable_checkpointing(model, kwargs)


def side(name: str):
    """The context of a side: ``off`` is ``shim.disabled()`` (upstream's behaviour, the layers inert)."""
    import shim

    return shim.disabled() if name == "off" else contextlib.nullcontext()


def gradients(model, inputs, call: str) -> dict:
    model.zero_grad(set_to_none=True)
    loss_of(model, inputs, call).backward()
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def measured_step(model, inputs, call: str, meter) -> dict:
    """One step with the meter on: held for backward, peak in backward, the step's peak (bytes
    above the step's start; the step peak in MB)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    figures = {}

    def step():
        start = meter.now()
        loss = loss_of(model, inputs, call)
        figures["held"] = meter.now() - start
        figures["backward_peak"] = meter.peak_of(loss.backward) - start

    figures["step_peak_mb"] = meter.step_peak(step)
    return figures


def timed_steps(model, inputs, call: str, meter, steps: int) -> float:
    """Median seconds of ``steps`` plain steps."""
    seconds = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        meter.sync()
        start = time.perf_counter()
        loss_of(model, inputs, call).backward()
        meter.sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure(options, meter, log) -> dict:
    """Every case, shim off and on: gradients checked, then ``--rounds`` rounds of a measured step
    and ``--steps`` timed steps per side (the sides' order alternates)."""
    from tests.steps import wrong_grads

    tolerance = dict(rtol=1e-5, atol=1e-6) if options.device == "cpu" else dict(rtol=1e-4, atol=1e-5)
    results, references, models = {}, {}, {}
    for case in CASES:
        if case.family not in models:
            models = {case.family: build(case.family, options, options.device)}  # one family alive at a time
        model, inputs = models[case.family]
        log(f"{case.name}")
        configure(model, case.checkpointing)
        record = {
            side_name: {"held": [], "backward_peak": [], "step_peak_mb": [], "seconds": []} for side_name in SIDES
        }
        for side_name in SIDES:  # warm-up, and the gradients against the same model without checkpointing
            with side(side_name):
                grads = gradients(model, inputs, case.call)
            if case.baseline is None:
                references.setdefault(case.name, grads)
            reference = references[case.baseline or case.name]
            record[side_name]["wrong"] = len(wrong_grads(reference, grads, **tolerance))
            record[side_name]["gradients"] = len(reference)
        for index in range(options.rounds):
            for side_name in SIDES if index % 2 == 0 else SIDES[::-1]:
                with side(side_name):
                    for key, value in measured_step(model, inputs, case.call, meter).items():
                        record[side_name][key].append(value)
                    record[side_name]["seconds"].append(timed_steps(model, inputs, case.call, meter, options.steps))
        results[case.name] = record
    return results


def medians(results: dict, key: str) -> dict:
    return {name: {s: statistics.median(record[s][key]) for s in SIDES} for name, record in results.items()}


# -- the report -------------------------------------------------------------------------------------


def report(results: dict, options) -> tuple[list[str], dict, bool]:
    """The table and the verdicts' lines, each case's verdict, and whether the run passes."""
    held = medians(results, "held")
    wrong = {name: {s: record[s]["wrong"] for s in SIDES} for name, record in results.items()}
    rows = []
    for case in CASES:
        record = results[case.name]
        for s in SIDES:
            figures = record[s]
            spread = (max(figures["held"]) - min(figures["held"])) / 1e3
            rows.append(
                [
                    case.name if s == "off" else "",
                    s,
                    f"{statistics.median(figures['held']) / MB:.2f}",
                    f"{spread:.1f}",
                    f"{statistics.median(figures['backward_peak']) / MB:.2f}",
                    f"{statistics.median(figures['step_peak_mb']):.1f}",
                    f"{statistics.median(figures['seconds']) * 1e3:.0f}",
                    f"{figures['wrong']} of {figures['gradients']} wrong" if figures["wrong"] else "right",
                ]
            )
    headers = ["case", "shim", "held MB", "spread KB", "bwd peak MB", "step peak MB", "step ms", "gradients"]
    verdicts = [verdict(case, held, wrong, judged=not options.quick) for case in CASES]
    judged = [v for v in verdicts if v["ok"] is not None]
    wrong_with_shim = [name for name, sides in wrong.items() if sides["on"]]
    if options.quick:  # constants of a few KB against savings of a few MB: a smoke run judges gradients only
        final = "quick: not judged" + (f"; gradients wrong with the shim: {wrong_with_shim}" if wrong_with_shim else "")
        ok = not wrong_with_shim
    else:
        ok = all(v["ok"] for v in judged)
        final = (
            f"{'holds' if ok else 'MISSED'}: the shim keeps checkpointing's memory saving within {WITHIN:.0%} of "
            "upstream's where upstream's run is correct, and of upstream's right run where it is not"
        )
    lines = [
        "Held for backward: after the loss less before the forward; bwd peak: the most in use during backward "
        "(the recomputation included) above the step's start; step peak: "
        + ("the CUDA peak of the step" if options.device == "cuda" else "VmHWM above VmRSS (noisy)")
        + f"; spread: max - min of the held figure over {options.rounds} round(s)",
        table(rows, headers, left=(0, 1, 7)),
        "",
        "Checkpointing's saving (held without checkpointing less held with it), shim on against upstream:",
        *(f"  {v['line']}" for v in verdicts if v["ok"] is not None),
        "",
        f"verdict: {final}",
    ]
    return lines, {case.name: v for case, v in zip(CASES, verdicts)}, ok


def environment(options, meter) -> str:
    import torch
    import transformers

    if options.device == "cuda":
        where = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        where = f"CPU, {torch.get_num_threads()} torch thread(s)"
    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}; {where}; memory: {meter.what}; "
        f"Llama {options.layers} layers, hidden {options.hidden}, sequence {options.seq}, batch {options.batch}; "
        f"Qwen2-VL tower depth {options.tower_depth}, width {options.tower_width}, image {options.image}px; "
        f"{options.rounds} round(s), {options.steps} timed step(s) per round and side"
    )


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model and one round: a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tower-depth", type=int, default=8, help="frozen vision blocks")
    parser.add_argument("--tower-width", type=int, default=128)
    parser.add_argument("--image", type=int, default=64, help="image side in pixels")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--json", type=Path, help="write every figure and verdict here")
    options = parser.parse_args(argv)
    if options.quick:
        options.layers, options.hidden, options.seq, options.rounds, options.steps = 2, 64, 64, 1, 1
        options.tower_depth, options.tower_width, options.image = 2, 32, 16
    return options


def main(argv=None) -> int:
    options = arguments(argv)
    if options.device == "cpu":
        fixed_mmap_threshold()  # re-executes this script once, before anything is measured
    sys.path.insert(0, str(ROOT))
    import warnings

    import torch

    import shim
    from shim.tools.targets import quiet_transformers

    warnings.simplefilter("ignore")
    quiet_transformers()
    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("checkpoint_memory: --device cuda, and torch sees no CUDA device")
    torch.set_num_threads(options.threads)
    meter = CudaMeter() if options.device == "cuda" else HeapMeter()
    started = time.perf_counter()
    results = measure(options, meter, lambda what: print(f"  measuring {what}", file=sys.stderr, flush=True))
    lines, verdicts, ok = report(results, options)
    header = [
        "hf-train-shim: what checkpointing saves, shim off (shim.disabled()) and on, same process",
        environment(options, meter),
        f"patches applied: {', '.join(s.name for s in shim.status() if s.state == shim.APPLIED)}",
        "",
    ]
    print("\n".join([*header, *lines, f"({time.perf_counter() - started:.0f} s)"]))
    if options.json:
        summary = {"environment": environment(options, meter), "results": results, "verdicts": verdicts, "ok": ok}
        options.json.write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
