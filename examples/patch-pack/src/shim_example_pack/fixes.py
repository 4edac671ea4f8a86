"""``example-resume-complete-checkpoint``: resuming passes over a checkpoint whose save never finished.

Symptom: a run killed while it saved a checkpoint (preempted, out of time, out of disk) leaves a
``checkpoint-N`` folder without its ``trainer_state.json``, which the Trainer writes last.
``Trainer.train(resume_from_checkpoint=True)`` asks ``transformers.trainer_utils.get_last_checkpoint``
for the newest ``checkpoint-N`` folder, gets that one, and the resume fails on the files it lacks.

Fix: ``get_last_checkpoint`` is wrapped. When the folder it picks has no ``trainer_state.json``, the
newest folder that has one is returned instead (``None`` when none has: the Trainer then says that no
valid checkpoint was found), and the effect is counted. Every other call is upstream's, untouched.
The Trainer's own name for the function (``transformers.trainer`` imports it by name) is rebound
through ``consumers`` while the patch is on.

Limits: a checkpoint whose ``trainer_state.json`` was written but whose other files are damaged is
still chosen; ``resume_from_checkpoint="<path>"`` is used as given.

This docstring is what ``python -m shim explain example-resume-complete-checkpoint`` prints below the
patch's summary: a pack's patch is explained from its own text.
"""

import os
import re

from shim import BugProbe, Evidence, Patch, Target, record_effect

NAME = "example-resume-complete-checkpoint"
#: What the Trainer writes last into a checkpoint folder (``transformers.trainer.TRAINER_STATE_NAME``).
STATE = "trainer_state.json"
#: A checkpoint folder as the Trainer names it (``transformers.trainer_utils._re_checkpoint``).
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _newest_complete(wrapped, instance, args, kwargs):
    found = wrapped(*args, **kwargs)
    if found is None or os.path.isfile(os.path.join(found, STATE)):
        return found  # upstream's answer stands: the common path does one stat more, nothing else
    folder = args[0] if args else kwargs["folder"]
    steps = [
        (int(match.group(1)), entry)
        for entry in os.listdir(folder)
        if (match := CHECKPOINT.match(entry)) and os.path.isfile(os.path.join(folder, entry, STATE))
    ]
    record_effect(NAME, "passed over %s, which has no %s (its save never finished)", os.path.basename(found), STATE)
    return os.path.join(folder, max(steps)[1]) if steps else None


def _bug_probe() -> Evidence:
    """The bug probe: ``python -m shim doctor`` asks it with the patch off (the bug should show) and on
    (it must not); the shim asks it before applying the patch on a transformers build it was not
    measured on (a dev build, a newer release), and steps aside where it finds no bug. It takes
    transformers' function from the module the patch targets, already imported: a probe imports
    nothing. This bug lives on disk, so the probe writes a temporary folder (and removes it)."""
    import sys
    import tempfile

    get_last_checkpoint = sys.modules["transformers.trainer_utils"].get_last_checkpoint
    with tempfile.TemporaryDirectory() as folder:
        for step, finished in ((10, True), (20, False)):  # checkpoint-20: the save was cut short
            os.mkdir(os.path.join(folder, f"checkpoint-{step}"))
            if finished:
                with open(os.path.join(folder, f"checkpoint-{step}", STATE), "w") as state:
                    state.write("{}")
        if get_last_checkpoint(folder) == os.path.join(folder, "checkpoint-20"):
            return Evidence(True, f"get_last_checkpoint picks a checkpoint without {STATE} (its save never finished)")
    return Evidence(False, f"get_last_checkpoint picks the newest checkpoint with a {STATE}")


# The module stays light: it imports the shim and the standard library only, never the library it
# patches. The shim imports it once a target module is imported, as pyproject.toml lists them
# (`python -m shim index` writes that list from PATCH's targets).
PATCH = Patch(
    name=NAME,
    summary="Trainer.train(resume_from_checkpoint=True) resumes from the newest checkpoint whose save finished.",
    # The gate: the releases of the library patched that have the bug. The pack's author read
    # get_last_checkpoint in them; the upper bound makes them look again at the next major release.
    distribution="transformers",
    requires=">=4.57,<6",
    targets=(Target("transformers.trainer_utils:get_last_checkpoint", _newest_complete),),
    consumers=("transformers.trainer",),  # `from .trainer_utils import get_last_checkpoint` there
    bug_probe=BugProbe(_bug_probe),
)
