"""The help texts of ``python -m shim``, fitted to 100 columns (``tests/tools/test_cli_edges.py``)."""

ENVIRONMENT = """\
environment variables (read when a patch applies, so set them before importing transformers):
  SHIM_DISABLE=all | name,name   apply nothing / opt these patches out ('_', '-' and case are equal)
  SHIM_FORCE=name,name           apply these patches even outside their version gate
  SHIM_STRICT=1                  a patch that should apply but cannot raises shim.PatchError
  SHIM_LOG_LEVEL=INFO            show the shim's log lines (what applied, first effects) on stderr
  SHIM_REPORT=1 | 0              at exit, on stderr: the effects table | nothing (unset: one line
                                 where a fix acted; under torchrun one for the job)"""

DESCRIPTION = """\
hf-train-shim: what the shim did in this environment, and whether the bugs it fixes are there.

commands:
  status    (default) one row per patch: state, installed version, effects so far, the reason;
            the patch's one-line summary below it
  doctor    reproduce each bug on a tiny model built in code, with its patch off and then on
  explain   explain <patch>: the bug a patch fixes, the versions measured, the fix and its limits;
            without a name, every patch and its summary
  bug-report  the versions, the status, doctor and the SHIM_* variables, as Markdown to paste
  new-pack  new-pack NAME [DIR]: write a patch pack of your own that works as it is
  index     write each patch's record: a pack's pyproject.toml tables (--check: are they current)
  run       run [--] <command ...> with the shim imported first in every Python process it starts
            (torchrun, accelerate launch, deepspeed and their ranks); also the shim-run command"""

STATES = """\
states:
  applied     in place: its wrappers act while it is switched on
  will apply  its target module is not imported yet; its gate and the installed versions admit it:
              it applies right after that import (shim.status() and --json say pending)
  will skip   its target module is not imported yet, and no target of it is for these versions
  will probe  as will apply, on a build the shim was not measured on (dev, git, editable, newer):
              the patch's bug probe decides at that import (SHIM_PROBE)
  skipped     not needed or not safe here (outside its gate, library not installed, code changed,
              its bug probe found upstream's fix: it steps aside)
  disabled    switched off (SHIM_DISABLE, shim.disable(), shim.deactivate())
  failed      wrapping raised and was rolled back, or another patcher replaced its layer
  (a state followed by ", suspended": off inside a shim.disabled() block)"""

EXIT_CODES = """\
exit codes:
    0  success (status always; doctor: nothing that applies here is left unfixed, or it cannot
       check here: torch cannot be imported)
    1  doctor: a bug that applies to the installed versions is NOT FIXED, or a bug probe errored
    2  the command line was not understood, or the output cannot be written (doctor's
       --json-file, a closed stdout: python -m shim >&-); a one-line message says which
  141  the reader of the output went away before the end (python -m shim doctor --json | head)"""

DOCTOR_DESCRIPTION = """\
Ask every patch's bug probe, a tiny case built in code (nothing is downloaded), once with the patch
switched off (does the bug show on the installed versions?) and once on (is it gone?).

verdicts:
  fixed              the bug shows upstream and the patch removes it
  NOT FIXED          the bug shows and the patch does not remove it (or cannot apply here)
  not affected       the patch does not apply here and the bug does not show
  not reproduced     the patch applies but its bug probe does not find the bug here
  fixed upstream     its bug probe found upstream's fix on this build: the patch steps aside
  opted out          switched off (SHIM_DISABLE); the bug probe was asked without it
  not installed      the library the patch is for is not installed
  check error        the bug probe itself raised (the detail says what)
  cannot check here  no bug probe can run in this environment (torch cannot be imported)"""
