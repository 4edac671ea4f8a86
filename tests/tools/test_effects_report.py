"""The effects ledger as a user reads it: the first effect of each patch said once in the log, the
counts in ``shim.report()`` and in the report ``SHIM_REPORT=1`` prints at exit. What each patch counts
is tested beside the patch (``tests/patches/test_<patch>.py``, the ``ledger`` fixture)."""

import itertools
import logging

import pytest
import transformers

import shim
from shim import runtime as effects
from tests.conftest import run_python
from tests.patches.checkpointing_cases import TRANSFORMERS, configure, tiny_llama


@pytest.fixture(autouse=True)
def empty_ledger():
    effects.clear()
    yield
    effects.clear()


def test_the_first_effect_of_each_patch_is_logged_once_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="shim"):
        for _ in range(3):
            effects.record("demo-patch", "kept %d thing(s) of %s", 2, "Model")
    lines = [r for r in caplog.records if r.name == "shim"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage().startswith("demo-patch: kept 2 thing(s) of Model (first effect in this process")
    assert (effects.count("demo-patch"), effects.last("demo-patch")) == (3, "kept 2 thing(s) of Model")


def test_report_lists_what_changed_and_what_did_not():
    model = tiny_llama()
    configure(model, {"use_reentrant": True, "selective": False})
    text = shim.report()
    assert text.splitlines()[0].startswith("hf-train-shim report (pid ")
    assert text.splitlines()[0].endswith(f": 1 of {len(shim.status())} patches changed something")
    lines = text.splitlines()
    row = lines.index("  checkpoint-kwargs-clean        1")
    assert lines[row + 1].startswith("      last effect: took selective out of the checkpointing kwargs")
    assert max(len(line) for line in lines) <= 100


TRAINING_SCRIPT = """
import shim
import tempfile, torch
from tests.tinymodels import frozen_llama_class
from shim.tools.targets import quiet_transformers
from tests.tinymodels import tiny_llama_config
quiet_transformers()
model_class = frozen_llama_class()
with tempfile.TemporaryDirectory() as directory:
    model_class(tiny_llama_config()).save_pretrained(directory)
    model = model_class.from_pretrained(directory)
model.train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True, "preserve_rng_state": False})
model.gradient_checkpointing_disable()
model.gradient_checkpointing_enable()  # as trl does around generation
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
ids = torch.randint(0, 64, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
print("trained")
"""


@pytest.mark.skipif(TRANSFORMERS.major < 5, reason="version rule: the load effect needs transformers 5.x")
def test_a_training_script_reports_its_effects_at_exit_and_logs_the_first_ones():
    reported = run_python(TRAINING_SCRIPT, env={"SHIM_REPORT": "1", "RANK": "1"}, torch_first=True)
    assert "trained" in reported.stdout
    report = reported.stderr[reported.stderr.index("[rank 1] hf-train-shim report (pid ") :].splitlines()
    assert all(line.startswith("[rank 1] ") for line in report)
    assert max(len(line) for line in report) <= 100, "the [rank 1] prefix included"
    rows = [line.removeprefix("[rank 1] ") for line in report]

    def last_effect(row: str) -> str:  # the wrapped lines below a patch's row, joined again
        below = rows[rows.index(row) + 1 :]
        return " ".join(line.strip() for line in itertools.takewhile(lambda line: line.startswith(" " * 6), below))

    assert last_effect("  load-keeps-requires-grad       10") == (
        f"last effect: kept 10 parameter(s) of FrozenBaseLlama frozen that transformers {transformers.__version__} "
        "made trainable while loading"
    )
    assert last_effect("  checkpointing-restore           1").startswith(
        "last effect: FrozenBaseLlama was re-enabled without a configuration"
    )

    logged = run_python(TRAINING_SCRIPT, env={"SHIM_LOG_LEVEL": "INFO"}, torch_first=True).stderr
    assert "shim INFO: load-keeps-requires-grad: kept 1 parameter(s) of FrozenBaseLlama frozen" in logged
    assert "shim INFO: checkpointing-restore: FrozenBaseLlama was re-enabled without a configuration" in logged
    assert logged.count("load-keeps-requires-grad: kept") == 1, "logged once, counted always"
    assert "hf-train-shim report" not in logged


# -- the exit report is written as whole lines ---------------------------------------------------------


@pytest.mark.any_version
def test_the_exit_report_reaches_stderr_as_whole_lines_in_single_writes(monkeypatch):
    """Ranks under one launcher share a stderr: each ``os.write`` of the report holds whole lines (the
    last one ends in a newline), none is larger than a pipe takes at once unless one line is, and
    together they are the report. ``print`` wrote the text and its newline apart, and another rank's
    report landed between them (``...zero3-frozen-recompute[rank 0] hf-train-shim report``)."""
    import io
    import os

    from shim.tools import report

    read, write = os.pipe()
    writes = []
    real_write = os.write

    def recorded(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    lines = [f"[rank 1]   line {i}: " + "x" * 90 for i in range(120)]  # ~12 kB: more than one pipe write
    with open(write, "w", encoding="utf-8", closefd=True) as stream:
        monkeypatch.setattr(report.sys, "stderr", stream)
        monkeypatch.setattr(report.os, "write", recorded)
        stream.write("before ")  # something of the program's own, still in the stream's buffer
        report.write_whole_lines("\n".join(lines))
        monkeypatch.undo()
    with open(read, "rb") as pipe:
        written = pipe.read()
    assert written == ("before " + "\n".join(lines) + "\n").encode()
    assert b"".join(writes) == ("\n".join(lines) + "\n").encode()
    assert len(writes) > 1 and all(chunk.endswith(b"\n") and len(chunk) <= report.PIPE_BUF for chunk in writes)
    # Each chunk holds as many whole lines as a pipe takes at once: the next chunk's first line would not fit.
    assert all(len(a) + len(b.split(b"\n")[0]) + 1 > report.PIPE_BUF for a, b in zip(writes, writes[1:]))

    captured = io.StringIO()  # a stderr without a file descriptor (pytest's capture): one write
    monkeypatch.setattr(report.sys, "stderr", captured)
    report.write_whole_lines("a\nb")
    assert captured.getvalue() == "a\nb\n"
