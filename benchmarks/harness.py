"""The benchmarks' shared harness: how they time, compare, read memory, start child interpreters and
print their verdicts. Standard library only, so a child interpreter imports it before ``import shim``.

- statistics: quartiles; an on/off comparison as the median of the per-round ratios; ABBA
  interleaving (on/off order alternates each round, so a drift in machine load cancels out); CPU
  and wall clocks; nanoseconds per call through ``timeit``
- memory (Linux): resident set size, and its high-water mark (``VmHWM``) restarted through
  ``/proc/self/clear_refs``; the time and peak of one step for the per-patch benchmarks
- child interpreters: pinned to the parent's CPU (inherited), one thread, quiet, the checkout first
  on ``PYTHONPATH``, answering one ``RESULT {json}`` line
- the report: aligned tables, numbers, and each target's verdict
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"import": 1.01, "load": 1.02, "step": 1.01, "memory": 1.01, "cycle": 1.10, "generate": 1.005}
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


# -- statistics -------------------------------------------------------------------------------------


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


def median_sample(samples: list) -> list:
    return [statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)]


def timed(function, per: int = 1) -> list:
    """``[cpu, wall]`` seconds of one ``function()`` after a collection, divided by ``per``."""
    gc.collect()
    with Clock() as clock:
        function()
    return [clock.sample[0] / per, clock.sample[1] / per]


def per_call_ns(function, seconds: float) -> float:
    """Best of 5 ``timeit`` repeats of about ``seconds`` each, in ns per call."""
    timer = timeit.Timer(function)
    number, _ = timer.autorange()
    number = max(1, int(number * seconds / 0.2))
    return min(timer.repeat(repeat=5, number=number)) / number * 1e9


# -- memory -----------------------------------------------------------------------------------------


def fixed_mmap_threshold() -> None:
    """Re-execute this script once with glibc's mmap threshold fixed (Linux): its dynamic threshold
    would keep freed activations in the heap and blur the per-step peaks. Call it before torch is
    imported."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and sys.platform.startswith("linux"):
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
        os.execv(sys.executable, [sys.executable, *sys.argv])


def _status_kib(field: str):
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    kib = _status_kib("VmRSS")
    return _maxrss_mib() if kib is None else kib / 1024


def peak_mib() -> float:
    kib = _status_kib("VmHWM")
    return _maxrss_mib() if kib is None else kib / 1024


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


def timed_step(step: Callable[[], object]) -> tuple[float, int]:
    """Seconds ``step()`` takes and the KiB its peak resident memory rises above where it started
    (Linux only: the high-water mark is restarted through ``/proc/self/clear_refs``)."""
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return seconds, _status_kib("VmHWM") - before


# -- child interpreters -----------------------------------------------------------------------------


def pin(cpu: str) -> str:
    """Quiet this process and pin it (and so every child) to one CPU: an index, 'last' or 'none'."""
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


def run_child(argv: list, env: dict, timeout: int = 600) -> dict:
    """Run ``argv`` from the checkout and return the JSON of its last ``RESULT `` line."""
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark subprocess failed ({result.returncode}): {argv}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def answer(result: dict) -> None:
    """What a child prints for :func:`run_child`."""
    print("RESULT " + json.dumps(result))


# -- the report -------------------------------------------------------------------------------------

HEADERS = ["measurement", "on", "off", "ratio", "ratio IQR", "noise", "wall ratio", "n", "target"]


def table(rows, headers, left=(0,)) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(
        c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    ).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def verdict(result: dict, kind: str, quick: bool) -> str:
    """``holds``; ``noise`` when the median misses but the lower quartile of the ratios does not.
    A quick run has too few rounds to judge a target; a ``cross`` row is judged elsewhere."""
    if kind == "cross":
        return "(*)"
    target = TARGETS[kind]
    if quick:
        return f"<= {target:.2f} (quick: not judged)"
    state = "holds" if result["ratio"] <= target else "noise" if result["ratio_q25"] <= target else "MISSED"
    return f"<= {target:.2f} {state}"


def number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def comparison_row(label, result, scale, kind=None, quick=False):
    """A row of :data:`HEADERS` for one :func:`compare` result, times ``scale``."""
    return [
        label,
        number(result["on"] * scale),
        number(result["off"] * scale),
        f"{result['ratio']:.3f}",
        f"{result['ratio_q25']:.3f}-{result['ratio_q75']:.3f}",
        f"{result['noise'] * 100:.0f}%",
        f"{result['wall_ratio']:.3f}" if "wall_ratio" in result else "",
        str(result["n"]),
        verdict(result, kind, quick) if kind else "",
    ]


def noise_line(groups) -> list[str]:
    """The closing line: the spread of every timing (a comparison with a wall ratio) in ``groups``."""
    timings = [r for group in groups for r in group.values() if isinstance(r, dict) and "wall_ratio" in r]
    if not timings:
        return []
    noise = sorted(r["noise"] for r in timings)
    return [
        "",
        f"Noise: relative IQR of the timings {noise[0] * 100:.0f}-{noise[-1] * 100:.0f}% "
        f"(median {statistics.median(noise) * 100:.0f}%); cross-process rows also carry the scatter between "
        "interpreters (memory layout), which more steps per process do not remove",
    ]
