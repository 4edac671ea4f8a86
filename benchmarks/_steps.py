"""Time and peak memory of one training step, for the benchmarks run by hand (Linux only).

The peak is the resident set size's high-water mark (``VmHWM``) above the resident size before
the step, after resetting the mark through ``/proc/self/clear_refs``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path


def memory_kib() -> tuple[int, int]:
    """(peak, current) resident set size of this process in KiB."""
    status = Path("/proc/self/status").read_text()
    return (int(re.search(r"VmHWM:\s+(\d+)", status).group(1)), int(re.search(r"VmRSS:\s+(\d+)", status).group(1)))


def timed_step(step: Callable[[], object]) -> tuple[float, int]:
    """Seconds ``step()`` takes and the KiB its peak resident memory rises above where it started."""
    _, before = memory_kib()
    Path("/proc/self/clear_refs").write_text("5")  # restart the high-water mark
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    peak, _ = memory_kib()
    return seconds, peak - before
