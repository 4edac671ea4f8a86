"""benchmarks/checkpoint_memory.py's own parts, without its measurement: glibc's count, the peak at
operator granularity, the cases it runs, and the verdict it prints. Nothing here is timed; the
benchmark's smoke run is tests/project/test_device_check.py's."""

import ctypes
import importlib.util
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.any_version

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark imports its harness as a script does
spec = importlib.util.spec_from_file_location("checkpoint_memory", ROOT / "benchmarks" / "checkpoint_memory.py")
memory = importlib.util.module_from_spec(spec)
sys.modules["checkpoint_memory"] = memory  # dataclasses look their module up there
spec.loader.exec_module(memory)
sys.path.remove(str(ROOT / "benchmarks"))

MB = 1_000_000


def test_bytes_in_use_are_the_heap_in_use_and_the_mmapped_blocks():
    info = memory.Mallinfo2(arena=1 << 30, uordblks=3 * MB, fordblks=7 * MB, hblkhd=40 * MB)
    assert memory.in_use(info) == 43 * MB  # free heap (fordblks) and the arena's size do not count
    assert ctypes.sizeof(memory.Mallinfo2) == 10 * ctypes.sizeof(ctypes.c_size_t)  # glibc's struct


def test_glibcs_count_sees_an_allocation_and_its_release():
    read = memory.mallinfo2()
    if read is None:
        pytest.skip("no glibc mallinfo2() here (musl, macOS, glibc < 2.33): the benchmark says so and stops")
    before = memory.in_use(read())
    block = ctypes.create_string_buffer(64 * MB)  # above any mmap threshold: mmapped, counted in hblkhd
    during = memory.in_use(read())
    del block
    assert during - before >= 64 * MB
    assert memory.in_use(read()) - before < MB


def test_the_heap_meter_reads_the_peak_inside_backward_at_operator_granularity():
    if memory.mallinfo2() is None:
        pytest.skip("no glibc mallinfo2() here")
    meter = memory.HeapMeter()
    weight = torch.ones(2048, 2048, requires_grad=True)
    size = weight.numel() * weight.element_size()  # 16.8 MB
    slack = MB  # what the interpreter and other threads free meanwhile (a few kB seen under load)
    start = meter.now()
    loss = (weight * weight).sum()
    peak = meter.peak_of(loss.backward)  # mul's backward: one gradient per operand, then their sum
    end = meter.now()
    assert weight.grad is not None
    assert peak - start >= 2 * size - slack, "both of mul's gradients were alive at once"
    assert peak - end >= size - slack, "a transient inside backward, which no reading after it sees"


def test_every_case_is_measured_from_a_baseline_of_its_own_model_and_call():
    names = [case.name for case in memory.CASES]
    assert len(names) == len(set(names))
    for case in memory.CASES:
        if case.baseline is None:
            assert case.checkpointing == "none" and case.reference is None
            continue
        baseline = memory.CASE[case.baseline]
        assert baseline.checkpointing == "none" and (baseline.family, baseline.call) == (case.family, case.call)
        if case.upstream_wrong:  # judged against an upstream run that is right, on the same model
            reference = memory.CASE[case.reference]
            assert reference.family == case.family and not reference.upstream_wrong
    covered = {(case.family, case.checkpointing, case.call) for case in memory.CASES}
    for needed in [
        ("llama", "non-reentrant", "positional"),
        ("llama", "reentrant", "positional"),
        ("llama", "reentrant", "keyword"),
        ("frozen-input", "reentrant", "embeds"),
        ("lora", "reentrant", "positional"),
        ("lora", "non-reentrant", "positional"),
        ("frozen-tower", "default", "model"),
    ]:
        assert needed in covered


def held(**cases) -> dict:
    """``held(name=(off MB, on MB))`` in bytes."""
    return {name: {"off": off * MB, "on": on * MB} for name, (off, on) in cases.items()}


def right(*names, wrong_off=()) -> dict:
    return {name: {"off": 9 if name in wrong_off else 0, "on": 0} for name in names}


def test_the_shim_must_keep_upstreams_saving_within_one_percent():
    case = memory.CASE["reentrant"]
    wrong = right("none", "reentrant")
    same = memory.verdict(case, held(none=(200, 200), reentrant=(20, 20)), wrong)
    assert same["ok"] and same["ratio"] == 1.0 and "holds" in same["line"]
    # 180 MB saved upstream: 1.7 MB less with the shim holds (1.8 MB is the edge), 1.9 MB less misses
    assert memory.verdict(case, held(none=(200, 200), reentrant=(20, 21.7)), wrong)["ok"]
    missed = memory.verdict(case, held(none=(200, 200), reentrant=(20, 21.9)), wrong)
    assert not missed["ok"] and "MISSED" in missed["line"]
    assert memory.verdict(case, held(none=(200, 200), reentrant=(20, 5)), wrong)["ok"], "saving more is no harm"
    assert memory.verdict(memory.CASE["none"], held(none=(200, 200)), wrong)["ok"] is None


def test_where_upstream_drops_gradients_the_shim_is_held_to_upstreams_right_run():
    case = memory.CASE["keyword reentrant"]
    figures = held(**{"none": (200, 200), "reentrant": (20, 20), "keyword none": (200, 200)})
    figures["keyword reentrant"] = {"off": 10 * MB, "on": 20 * MB}  # upstream saves more by dropping gradients
    wrong = right("none", "reentrant", "keyword none", "keyword reentrant", wrong_off=("keyword reentrant",))
    judged = memory.verdict(case, figures, wrong)
    assert judged["ok"] and judged["against"] == "reentrant" and judged["saving_off"] == 180 * MB
    assert "right run (reentrant; its own drops 9 gradients)" in judged["line"]
    figures["keyword reentrant"]["on"] = 25 * MB
    assert not memory.verdict(case, figures, wrong)["ok"]


def test_a_wrong_gradient_with_the_shim_fails_the_case_whatever_it_saves():
    case = memory.CASE["reentrant"]
    wrong = {"none": {"off": 0, "on": 0}, "reentrant": {"off": 0, "on": 2}}
    judged = memory.verdict(case, held(none=(200, 200), reentrant=(20, 20)), wrong)
    assert judged["ok"] is False and "2 gradients wrong with the shim" in judged["line"]


def test_a_smoke_run_judges_nothing_but_the_gradients():
    judged = memory.verdict(
        memory.CASE["reentrant"], held(none=(2, 2), reentrant=(1, 1.5)), right("none", "reentrant"), judged=False
    )
    assert judged["line"].endswith("not judged") and "MISSED" not in judged["line"]


class FakeCuda:
    """torch.cuda's allocator counters, driven by hand: ``allocate(n)`` / ``free(n)``."""

    def __init__(self):
        self.allocated = self.peak = 0

    def allocate(self, size):
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def free(self, size):
        self.allocated -= size

    def synchronize(self):
        pass

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated


def test_on_cuda_the_step_peak_keeps_the_forwards_peak_past_backwards_own_count():
    cuda = FakeCuda()
    meter = object.__new__(memory.CudaMeter)
    meter.cuda, meter.before_reset = cuda, 0
    cuda.allocate(100 * MB)  # the model
    figures = {}

    def step():
        start = meter.now()
        cuda.allocate(80 * MB)  # a forward temporary, freed before the loss
        cuda.free(80 * MB)
        cuda.allocate(20 * MB)  # held for backward
        figures["held"] = meter.now() - start

        def backward():
            cuda.allocate(30 * MB)  # the recomputation
            cuda.free(50 * MB)  # it and what was held, gone

        figures["backward_peak"] = meter.peak_of(backward) - start

    step_peak = meter.step_peak(step)
    assert figures == {"held": 20 * MB, "backward_peak": 50 * MB}
    assert step_peak == 80  # MB: the forward's temporary, which backward's restarted count no longer sees
