"""A fix that acts in a ``multiprocessing`` or ``torch.multiprocessing`` worker reaches the one line the
process that started it says at exit, whatever the start method: one line for the job, not one per
worker (``shim.tools.workers``). Each case is a fresh interpreter running a script, as a user's."""

import json
import re
import subprocess
import sys

import pytest

import shim
from tests.conftest import clean_environment, zygote

pytestmark = pytest.mark.any_version  # effects recorded by hand, but in the last case

SCRIPT = """
import multiprocessing, sys
import shim

def work(i):
    shim.record_effect("checkpointing-restore", "restored in worker %d", i)
    return i

if __name__ == "__main__":
    method, kind = sys.argv[1:]
    shim.record_effect("input-grad-hook-dedupe", "removed %d stale hook(s)", 1)
    if kind == "process":
        context = multiprocessing.get_context(method)
        workers = [context.Process(target=work, args=(i,)) for i in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    elif kind == "pool":
        pool = multiprocessing.get_context(method).Pool(2)
        pool.map(work, range(4))
        pool.close()
        pool.join()
    else:  # torch's
        import torch.multiprocessing
        torch.multiprocessing.spawn(work, nprocs=2)
"""

LINE = (
    "hf-train-shim (pid {pid}, no target module imported, and {workers}): 2 fixes acted: "
    "checkpointing-restore ×{n}, input-grad-hook-dedupe ×1 (SHIM_REPORT=1 for the table)"
)


def run(tmp_path, *args: str, env: dict | None = None, script: str = SCRIPT) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=tmp_path,
        env=clean_environment(env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done


def lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if "hf-train-shim" in line]


@pytest.mark.parametrize(
    "method, kind",
    [("fork", "process"), ("spawn", "process"), ("forkserver", "process"), ("spawn", "torch.multiprocessing.spawn")],
)
def test_what_workers_changed_is_in_the_one_line_of_the_process_that_started_them(tmp_path, method, kind):
    # fork workers end by os._exit and were never counted; spawn workers each said a line of their own.
    said = lines(run(tmp_path, method, kind))
    assert len(said) == 1, said
    pid = re.search(r"pid (\d+)", said[0]).group(1)
    assert said == [LINE.format(pid=pid, workers="2 workers", n=2)]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_pools_workers_are_counted_when_it_is_closed_and_joined(tmp_path, method):
    said = lines(run(tmp_path, method, "pool"))
    assert len(said) == 1, said
    # Four tasks on two workers: which worker runs how many is the pool's business.
    pattern = re.escape(LINE.format(pid="PID", workers="WORKERS", n=4))
    pattern = pattern.replace("PID", r"\d+").replace("WORKERS", "(1 worker|2 workers)")
    assert re.fullmatch(pattern, said[0]), said


def test_the_table_sums_the_workers_effects(tmp_path):
    stderr = run(tmp_path, "fork", "process", env={"SHIM_REPORT": "1"}).stderr.splitlines()
    titles = [line for line in stderr if line.startswith("hf-train-shim report")]
    assert len(titles) == 1 and re.match(
        r"hf-train-shim report \(pid \d+, no target module imported, and 2 workers\)", titles[0]
    )
    rows = dict(line.split() for line in stderr if re.fullmatch(r"  \S+ +\d+", line))
    assert rows == {"checkpointing-restore": "2", "input-grad-hook-dedupe": "1"}


def test_nothing_is_said_by_anyone_with_shim_report_0(tmp_path):
    assert run(tmp_path, "fork", "process", env={"SHIM_REPORT": "0"}).stderr == ""


DATALOADER = """
import torch
import shim

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        shim.record_effect("checkpointing-restore", "restored in a DataLoader worker")
        return torch.tensor(i)

loader = torch.utils.data.DataLoader(Data(), num_workers=2, multiprocessing_context="fork")
for epoch in range(2):  # each epoch's workers end when it does
    assert sum(int(x) for x in loader) == 28
"""


def test_what_dataloader_workers_changed_is_in_the_training_process_line():
    done = zygote().run(DATALOADER, 120)
    assert done.returncode == 0, done.stderr
    assert lines(done) == [
        "hf-train-shim (pid {pid}, no target module imported, and 4 workers): 1 fix acted: checkpointing-restore ×16 "
        "(SHIM_REPORT=1 for the table)".format(pid=re.search(r"pid (\d+)", done.stderr).group(1))
    ]


LATE = """
import multiprocessing, multiprocessing.util, time  # before the shim: its exit function runs after the report
import shim

def work():
    time.sleep(1)
    shim.record_effect("checkpointing-restore", "restored late")

if __name__ == "__main__":
    multiprocessing.get_context("fork").Process(target=work).start()  # never joined by the script
    shim.record_effect("input-grad-hook-dedupe", "removed %d stale hook(s)", 1)
"""


def test_a_worker_that_ends_after_the_report_says_its_own_line(tmp_path):
    said = lines(run(tmp_path, script=LATE))
    parent = re.search(r"pid (\d+)", said[0]).group(1)
    assert said[0] == (
        f"hf-train-shim (pid {parent}, no target module imported): 1 fix acted: input-grad-hook-dedupe ×1 "
        "(SHIM_REPORT=1 for the table)"
    )
    assert len(said) == 2 and said[1].endswith(
        f"multiprocessing worker, finished after the report of pid {parent}): 1 fix acted: checkpointing-restore ×1 "
        "(SHIM_REPORT=1 for the table)"
    ), said


A_FIX_IN_A_WORKER = """
import json, multiprocessing, sys
import torch
if {mode!r} != "without":
    import shim
from transformers.models.llama import configuration_llama, modeling_llama

def work():  # input-grad-hook-dedupe: each enable adds a hook upstream, the fix keeps one
    config = configuration_llama.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    model = modeling_llama.LlamaForCausalLM(config)
    for _ in range(3):
        model.enable_input_require_grads()
    sys.exit(len(model.get_input_embeddings()._forward_hooks))

worker = multiprocessing.get_context("fork").Process(target=work)
worker.start()
worker.join()
print(json.dumps({{"hooks": worker.exitcode}}))
"""


@pytest.mark.parametrize("mode", ["on", "off", "without"])
def test_a_fix_that_acts_only_in_a_fork_worker_is_said_once_at_exit(mode):
    import transformers.modeling_utils  # noqa: F401  (so that this process's status says whether the fix applies)

    env = {"SHIM_DISABLE": "all"} if mode == "off" else None
    done = zygote().run(A_FIX_IN_A_WORKER.format(mode=mode), 240, env=env)
    assert done.returncode == 0, done.stderr
    fixed = mode == "on" and shim.status()[shim.registry.names.index("input-grad-hook-dedupe")].state == "applied"
    assert json.loads(done.stdout.splitlines()[-1]) == {"hooks": 1 if fixed else 3}
    expected = [
        "hf-train-shim (this process and 1 worker): 1 fix acted: input-grad-hook-dedupe ×2 (SHIM_REPORT=1 for the table)"
    ]
    assert lines(done) == (expected if fixed else [])
