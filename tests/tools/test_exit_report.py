"""What the shim says at exit, as a user meets it in fresh interpreters: one line on stderr where a fix
acted (none where none did), the table with ``SHIM_REPORT=1``, nothing with ``SHIM_REPORT=0``; and
under torchrun one line (or table) for the job, not one per rank."""

import os
import subprocess
import sys

import pytest

from shim.patches import INDEX
from shim.tools import ranks, report
from tests.conftest import ROOT, clean_environment

#: The built-in patches: what a fresh interpreter registers (a test may have registered more in this one).
BUILTINS = [row["name"] for row in INDEX]

pytestmark = pytest.mark.any_version  # effects are recorded by hand here: the code as it is

#: Three effects of two patches, recorded out of name order; torch never imported.
ACTED = """
import atexit, sys
atexit.register(lambda: print("torch imported at exit:", "torch" in sys.modules))  # runs last
import shim
shim.record_effect("input-grad-hook-dedupe", "removed %d stale hook(s)", 1)
shim.record_effect("checkpointing-restore", "restored %s", "a")
shim.record_effect("checkpointing-restore", "restored %s", "b")
shim.record_effect("input-grad-hook-dedupe", "removed %d stale hook(s)", 2)
shim.record_effect("input-grad-hook-dedupe", "removed %d stale hook(s)", 3)
"""


def python(code: str, env: dict | None = None, cwd=ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean_environment(env), cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done


def test_one_line_at_exit_where_a_fix_acted_by_patch_name_and_nothing_imported():
    done = python(ACTED)
    assert done.stderr == (
        "hf-train-shim (pid {pid}, no target module imported): 2 fixes acted: checkpointing-restore ×2, "
        "input-grad-hook-dedupe ×3 (SHIM_REPORT=1 for the table)\n"
    ).format(pid=done.stderr.split("pid ")[1].split(",")[0]), "one line, however long"
    assert done.stdout == "torch imported at exit: False\n", "the line reads the ledger: no status, no import"


def test_a_training_process_says_its_line_plainly():
    code = "import shim, transformers.modeling_utils\nshim.record_effect('checkpointing-restore', 'restored')\n"
    assert python(code).stderr == "hf-train-shim: 1 fix acted: checkpointing-restore ×1 (SHIM_REPORT=1 for the table)\n"


@pytest.mark.parametrize("code", ["import shim", "import shim, transformers.modeling_utils"])
def test_nothing_at_exit_where_no_fix_acted(code):
    assert python(code).stderr == ""


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_shim_report_0_silences_the_line(value):
    assert python(ACTED, {"SHIM_REPORT": value}).stderr == ""


def test_shim_report_1_keeps_the_table_in_patch_name_order():
    stderr = python(ACTED, {"SHIM_REPORT": "1"}).stderr.splitlines()
    assert stderr[0].endswith(f": 2 of {len(BUILTINS)} patches changed something")
    rows = [line.split()[0] for line in stderr if line.startswith("  ") and line.split()[-1].isdigit()]
    assert rows == ["checkpointing-restore", "input-grad-hook-dedupe"]
    assert "      last effect: removed 3 stale hook(s)" in stderr
    start = next(i for i, line in enumerate(stderr) if line.startswith("  pending: "))
    wrapped = [stderr[start]] + [line for line in stderr[start + 1 :] if line.startswith("    ") and line[4] != " "]
    names = " ".join(line.strip() for line in wrapped).removeprefix("pending: ").split(", ")
    assert names == sorted(names) and len(names) > 1


def test_a_bad_value_warns_and_keeps_the_default_line():
    done = python(ACTED, {"SHIM_REPORT": "loud"})
    assert (
        "SHIM_REPORT='loud' is not valid; use one of 0, 1, false, no, off, on, true, yes; using one line" in done.stderr
    )
    assert "2 fixes acted: checkpointing-restore ×2" in done.stderr


# -- a job's ranks --------------------------------------------------------------------------------------

RANK = """
import os, time
import shim, transformers.modeling_utils
rank = int(os.environ["RANK"])
shim.record_effect("checkpointing-restore", "restored in rank %d", rank)
if rank == 0:
    shim.record_effect("load-keeps-requires-grad", "kept %d parameter(s) frozen", 4)
time.sleep(float(os.environ.get("SLEEP_IN_RANK_" + str(rank), "0")))
# The ranks end their work together unless a test makes one late, so that the report's wait for the
# other rank (ranks.JOIN_TIMEOUT) is not spent on a loaded machine's import of transformers.
open("done-%d" % rank, "w").close()
deadline = time.monotonic() + 120
while not any(name.startswith("SLEEP_IN_RANK_") for name in os.environ) and time.monotonic() < deadline:
    if os.path.exists("done-%d" % (1 - rank)):
        break
    time.sleep(0.05)
"""


def torchrun(tmp_path, env: dict, launcher: tuple = ()) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(RANK)
    command = [*launcher, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    environment = clean_environment({"OMP_NUM_THREADS": "1", **env})
    environment.pop("PYTHONPATH", None)
    done = subprocess.run(
        [*command, "train.py"], env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done


SHIM_RUN = (str(os.path.join(os.path.dirname(sys.executable), "shim-run")),)


@pytest.mark.parametrize("launcher", [(), SHIM_RUN], ids=["torchrun", "shim-run torchrun"])
def test_under_torchrun_one_line_for_the_job(tmp_path, launcher):
    lines = [line for line in torchrun(tmp_path, {}, launcher).stderr.splitlines() if "hf-train-shim" in line]
    assert lines == [
        "hf-train-shim (ranks 0-1): 2 fixes acted: checkpointing-restore ×2, load-keeps-requires-grad ×1 (rank 0) "
        "(SHIM_REPORT=1 for the table)"
    ], lines


def test_under_torchrun_one_table_for_the_job_with_the_ranks_each_fix_acted_in(tmp_path):
    stderr = torchrun(tmp_path, {"SHIM_REPORT": "1"}).stderr.splitlines()
    assert [line for line in stderr if "hf-train-shim report" in line] == [
        f"hf-train-shim report (ranks 0-1): 2 of {len(BUILTINS)} patches changed something"
    ]
    table = stderr[stderr.index(next(line for line in stderr if "hf-train-shim report" in line)) :]
    assert table[1].split() == ["patch", "effects", "ranks"]
    assert table[3].split() == ["checkpointing-restore", "2", "ranks", "0-1"]
    assert table[4].strip() == "last effect (rank 1): restored in rank 1"
    assert table[5].split() == ["load-keeps-requires-grad", "1", "rank", "0"]
    assert table[6].strip() == "last effect (rank 0): kept 4 parameter(s) frozen"


def test_a_rank_that_finishes_late_says_its_own_line_and_none_is_lost(tmp_path):
    """Rank 0 waits for rank 1 at most ranks.JOIN_TIMEOUT seconds, then says the job's line for what it
    has; rank 1, later, finds it said and says its own: every effect is said once."""
    sleep = {"SLEEP_IN_RANK_1": str(ranks.JOIN_TIMEOUT + 1.5)}
    lines = [line for line in torchrun(tmp_path, sleep).stderr.splitlines() if "hf-train-shim" in line]
    assert sorted(lines) == sorted(
        [
            "hf-train-shim (rank 0; 1 of 2 had not finished): 2 fixes acted: checkpointing-restore ×1, "
            "load-keeps-requires-grad ×1 (SHIM_REPORT=1 for the table)",
            "[rank 1] hf-train-shim (finished after the job's report): 1 fix acted: checkpointing-restore ×1 "
            "(SHIM_REPORT=1 for the table)",
        ]
    ), lines


def test_the_job_is_what_the_launcher_gives_every_rank_alike(monkeypatch):
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}
    found = ranks.job(env)
    assert (found.rank, found.local_rank, found.expected) == (1, 1, 2)
    assert found.folder.parent == ranks.home()
    assert ranks.job(env | {"RANK": "0", "LOCAL_RANK": "0"}).folder == found.folder, "one folder for the job"
    assert ranks.job(env | {"TORCHELASTIC_RUN_ID": "y"}).folder != found.folder, "another start, another folder"
    assert ranks.job(env | {"WORLD_SIZE": "1"}) is None and ranks.job({"RANK": "0"}) is None
    assert ranks.job({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2"}).expected == 2  # deepspeed's name


def test_the_job_report_merges_ranks_and_names_where_each_fix_acted():
    joined = ranks.Joined(
        [
            {"rank": 0, "pid": 1, "effects": {"b-fix": 2, "a-fix": 1}, "last": {"b-fix": "b0", "a-fix": "a0"}},
            {"rank": 1, "pid": 2, "effects": {"b-fix": 3}, "last": {"b-fix": "b1"}},
        ]
    )
    assert report.job_report(joined, 3, table=False) == (
        "hf-train-shim (ranks 0-1; 1 of 3 had not finished): 2 fixes acted: a-fix ×1 (rank 0), b-fix ×5 "
        "(SHIM_REPORT=1 for the table)"
    )
    assert [report.rank_list(r) for r in ([3], [0, 1, 2], [0, 2], [0, 1, 3])] == [
        "rank 3",
        "ranks 0-2",
        "ranks 0, 2",
        "ranks 0-1, 3",
    ]
