"""One exit report for a job's ranks, not one per rank.

Under ``torchrun``, ``accelerate launch`` or ``deepspeed`` (with or without ``shim-run``) each rank is
its own process with its own effects. At exit every rank writes what it counted to a file in a folder
of the job's own, ``<tempdir>/hf-train-shim-<uid>/<job>``, named after what the launcher gives all
ranks of one start on one machine alike (``TORCHELASTIC_RUN_ID``, the restart count, ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, the machine's ``GROUP_RANK`` and the launcher's pid, the ranks'
parent). The rank that finds every rank of its machine there (``LOCAL_WORLD_SIZE``) prints the
job's line (or table) for them all; a ``mkdir`` decides, should two find it at once. The cost stays
bounded: a few small files, no import, and one wait, with a timeout: local rank 0 waits at most
:data:`JOIN_TIMEOUT` seconds for the others, then prints what it has and names the ranks missing. A
rank that finishes after that takes its file back and prints its own line, so no count goes unsaid.
Ranks on other machines write to their own machine's folder: one line per machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: How long local rank 0 waits at exit for the files of the other ranks of its machine.
JOIN_TIMEOUT = 5.0
_POLL = 0.02
#: A job's folder left behind (a rank that never finished, a job killed at exit) is removed by a job
#: started this many seconds later.
STALE = 24 * 3600
CLAIMED = "claimed"


@dataclass(frozen=True)
class Joined:
    """What a rank prints at exit: the records of the ranks it reports for, ``late`` when it is its
    own alone, after the job's report was printed without it."""

    records: list[dict[str, Any]]
    late: bool = False


@dataclass(frozen=True)
class Job:
    folder: Path
    rank: int
    local_rank: int
    expected: int  # the ranks of this machine, whose files make the job's report complete


def job(environ: Any = None) -> Job | None:
    """This process's job, when a launcher started it as one rank of several (``RANK`` and a
    ``WORLD_SIZE`` above 1); ``None`` otherwise."""
    env = os.environ if environ is None else environ
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world <= 1:
        return None
    try:
        local = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)
        local_rank = int(env.get("LOCAL_RANK") or rank)
    except ValueError:
        local, local_rank = world, rank
    names = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    key = "|".join([*(env.get(name, "") for name in names), str(world), str(os.getppid())])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Job(home() / digest, rank, local_rank, max(local, 1))


def home() -> Path:
    """Where the jobs' folders are: one per user in the temporary directory."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"hf-train-shim-{uid}"


def join(found: Job, counted: dict[str, Any]) -> Joined | None:
    """Hand this rank's ``counted`` to the job: what this process prints (the job's report, or its
    own alone when it finished after the job's report was printed), or ``None`` (another rank prints)."""
    folder = found.folder
    prepare(folder)
    mine = folder / f"rank-{found.rank}.json"
    write(mine, counted | {"rank": found.rank})
    deadline = time.monotonic() + (JOIN_TIMEOUT if found.local_rank == 0 else 0.0)
    while True:
        if not mine.exists():
            return None  # the rank that printed the job's report took it
        if (folder / CLAIMED).exists():
            return take_back(mine)
        present = sorted(folder.glob("rank-*.json"))
        complete = len(present) >= found.expected
        if complete or (found.local_rank == 0 and time.monotonic() >= deadline):
            joined = _claim(folder, mine)
            if complete and joined is not None and not joined.late:
                remove(folder)  # every rank is in: none can come late
            return joined
        if found.local_rank != 0:
            return None  # the rank that completes the set, or local rank 0, prints
        time.sleep(_POLL)


def _claim(folder: Path, mine: Path) -> Joined | None:
    try:
        (folder / CLAIMED).mkdir()
    except FileExistsError:  # another rank saw the set complete at the same moment
        return take_back(mine)
    return Joined(sorted(take_all(folder, "rank-*.json"), key=lambda record: int(record["rank"])))


def take_all(folder: Path, pattern: str) -> list[dict[str, Any]]:
    """The records of the files ``pattern`` matches in a ``folder`` this process claimed (its
    :data:`CLAIMED` made): each moved there first, so that one whose writer takes it back at the
    same moment is had whole by one side or the other; one that cannot be read is left out."""
    records = []
    for path in sorted(folder.glob(pattern)):
        taken = folder / CLAIMED / path.name
        try:
            os.rename(path, taken)
            records.append(json.loads(taken.read_text(encoding="utf-8")))
            taken.unlink()
        except (OSError, ValueError):
            continue
    return records


def take_back(mine: Path) -> Joined | None:
    """After the job's report was claimed: ``None`` when it took this rank's file, else this rank's own
    record (it came too late for the job's report and is printed alone)."""
    late = mine.with_suffix(".late")
    try:
        os.rename(mine, late)
    except OSError:
        return None
    try:
        return Joined([json.loads(late.read_text(encoding="utf-8"))], late=True)
    except (OSError, ValueError):
        return None
    finally:
        late.unlink(missing_ok=True)


def write(path: Path, record: dict[str, Any]) -> None:
    """``record`` as ``path``, whole or not at all (another rank lists the folder meanwhile)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(record), encoding="utf-8")
    os.replace(partial, path)


def prepare(folder: Path) -> None:
    """The job's folder, and the folders of jobs long over removed (each job leaves one, small)."""
    parent = folder.parent
    parent.mkdir(mode=0o700, exist_ok=True)
    now = time.time()
    try:
        old = [path for path in parent.iterdir() if path != folder and now - path.stat().st_mtime > STALE]
    except OSError:
        old = []
    for path in old:
        remove(path)
    folder.mkdir(mode=0o700, exist_ok=True)


def remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
