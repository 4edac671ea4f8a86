"""Fresh interpreters, forked from one that has imported torch, for scripts that start with it anyway.

A script that imports the whole stack costs about 7 CPU-seconds, 4.5 of them in torch and the parts
of it transformers imports (``torch._dynamo``, ``torch.distributed.tensor``). A :class:`Zygote` is
one interpreter that has imported those and nothing else (no shim, no transformers, no target of a
patch) and forks a child per script: the child runs the script as ``python -c`` would (or as
``python script.py args``: ``argv``), in the zygote's ``__main__``, and runs in a session of its
own, so a timeout kills it with every thread and process it started (so does its end: whatever it
left behind). It exits as an interpreter does, as far as a script can see: an exception's traceback
and exit status 1, ``SystemExit``'s status, its threads joined, its atexit functions run, stdout and
stderr flushed; then ``os._exit``, without the teardown of every module, which in a fork of an
interpreter that has torch writes to nearly every page it shares with the zygote (0.7 CPU-seconds
a child, an empty script's whole cost).

Only for scripts whose first step is ``import torch``, or that test nothing torch's import could
change, so that what they test (the order of the shim, transformers, trl and a model; the torch
state the first import runs in; the shim's output; an everyday workflow with the shim off and on)
starts after what the zygote has done: tests/engine/test_reliability.py's import orders, threads importing and ambient
states, ``run_python(..., torch_first=True)`` and the do-no-harm workflows (never for a script that
checks what ``import shim`` imports, or blocks torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

from tests.conftest import ROOT

PRELOADED = ("torch", "torch._dynamo", "torch.distributed.tensor")

SERVER = """
import json, os, signal, sys, time
for name in {preloaded!r}:
    __import__(name)


def child(request):  # a fresh interpreter after `import torch`, as far as the script can tell
    import os, sys  # locals: the script gets __main__ to itself

    os.setsid()
    os.environ.update(request["env"])  # before the script imports the shim, which reads them
    if request["folder"]:  # as `python script.py` in that folder, without PYTHONPATH
        os.chdir(request["folder"])
        given = os.environ.pop("PYTHONPATH", "").split(os.pathsep)
        sys.path[:] = [request["folder"]] + [path for path in sys.path[1:] if path not in given]
    finish = exit_as_the_interpreter_does  # before __main__, where it is defined, is the script's
    main = vars(sys.modules["__main__"])
    for name in [name for name in main if not name.startswith("__")]:
        del main[name]
    filename = "<string>"
    if request["argv"]:  # `python script.py args...`: its argv, __file__ and folder first on sys.path
        sys.argv[:] = request["argv"]
        filename = main["__file__"] = request["argv"][0]
        if not request["folder"]:
            sys.path[0] = os.path.dirname(os.path.abspath(filename))
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # never the zygote's requests
    sys.stdin = open(os.devnull)
    try:
        exec(compile(request["code"], filename, "exec"), main)
        status = 0
    except SystemExit as stop:  # as the interpreter reads it
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code
        else:  # a message: printed, exit status 1
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException as error:  # as python -c ends on it: the traceback, exit 1
        error.__traceback__ = error.__traceback__.tb_next  # from the script's frame on
        sys.excepthook(type(error), error, error.__traceback__)
        status = 1
    finish(status or 0)


def exit_as_the_interpreter_does(status):
    \"\"\"What ``Py_FinalizeEx`` does that a script can see: wait for its threads, run its atexit
    functions, flush stdout and stderr; then end without tearing down the modules one by one (0.7
    CPU-seconds of a fork of an interpreter that has torch, most of an empty script's cost).\"\"\"
    import atexit, ctypes, os, sys, threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = status or 120  # as the interpreter exits when its last flush fails
    ctypes.CDLL(None).fflush(None)  # and C's stdio buffers, as exit() flushes them
    os._exit(status)


print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    deadline, returncode = time.monotonic() + request["timeout"], None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            returncode = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.01)
    try:
        os.killpg(pid, signal.SIGKILL)  # the child after a timeout; always whatever its session left behind
    except (ProcessLookupError, PermissionError):
        pass
    if returncode is None:
        os.waitpid(pid, 0)
    print(json.dumps({{"returncode": returncode}}), flush=True)
"""


class Zygote:
    """One preloaded interpreter; :meth:`run` forks a child per script, one script at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, "-c", SERVER.format(preloaded=PRELOADED)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        assert self._process.stdout is not None and self._process.stdout.readline() == "ready\n"

    def run(
        self,
        code: str,
        timeout: float,
        env: dict[str, str] | None = None,
        folder: str | None = None,
        argv: list[str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``code`` in a child; ``returncode`` is ``None`` when it was killed after ``timeout``.
        ``env``: set in the child before the script runs; ``folder``: run it as a script there
        (its cwd and ``sys.path[0]``), without the zygote's PYTHONPATH; ``argv``: run it as
        ``python argv[0] argv[1:]`` (``code`` is that file's text): its ``sys.argv``, ``__file__``,
        and its folder first on ``sys.path``."""
        assert self._process.stdin is not None and self._process.stdout is not None
        with tempfile.TemporaryDirectory() as directory, self._lock:
            paths = {stream: os.path.join(directory, stream) for stream in ("stdout", "stderr")}
            for path in paths.values():
                open(path, "w").close()
            self._process.stdin.write(
                json.dumps(
                    {"code": code, "timeout": timeout, "env": env or {}, "folder": folder, "argv": argv, **paths}
                )
                + "\n"
            )
            self._process.stdin.flush()
            returncode = json.loads(self._process.stdout.readline())["returncode"]
            with open(paths["stdout"]) as out, open(paths["stderr"]) as err:
                return subprocess.CompletedProcess(["zygote"], returncode, out.read(), err.read())

    def close(self) -> None:
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()
        self._process.kill()  # it holds nothing to save: no waiting for torch's interpreter shutdown
        self._process.wait(timeout=30)
