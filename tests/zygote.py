"""Fresh interpreters, forked from one that has imported torch, for scripts that start with it anyway.

A script that imports the whole stack costs about 8.5 CPU-seconds, 6 of them in torch and the parts
of it transformers imports (``torch._dynamo``, ``torch.distributed.tensor``). A :class:`Zygote` is
one interpreter that has imported those and nothing else (no shim, no transformers, no target of a
patch) and forks a child per script: the child runs the script as ``python -c`` would, in the
zygote's ``__main__``, exits as an interpreter does (atexit, threads joined), and runs in a session
of its own, so a timeout kills it with every thread and process it started.

Only for scripts whose first step is ``import torch``, or that test nothing torch's import could
change, so that what they test (the order of the shim, transformers, trl and a model; the torch
state the first import runs in; the shim's output) starts after what the zygote has done:
tests/engine/test_reliability.py's import orders and ambient states, and ``run_python(...,
torch_first=True)`` (never for a script that checks what ``import shim`` imports, or blocks torch).
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
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    sys.stdin = open(os.devnull)
    code = compile(request["code"], "<string>", "exec")
    main = vars(sys.modules["__main__"])
    for name in [name for name in main if not name.startswith("__")]:
        del main[name]
    exec(code, main)
    sys.exit(0)  # an exception above ends the child as it ends python -c: traceback, exit 1


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
    else:
        os.killpg(pid, signal.SIGKILL)
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
        self, code: str, timeout: float, env: dict[str, str] | None = None, folder: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``code`` in a child; ``returncode`` is ``None`` when it was killed after ``timeout``.
        ``env``: set in the child before the script runs; ``folder``: run it as a script there
        (its cwd and ``sys.path[0]``), without the zygote's PYTHONPATH."""
        assert self._process.stdin is not None and self._process.stdout is not None
        with tempfile.TemporaryDirectory() as directory, self._lock:
            paths = {stream: os.path.join(directory, stream) for stream in ("stdout", "stderr")}
            for path in paths.values():
                open(path, "w").close()
            self._process.stdin.write(
                json.dumps({"code": code, "timeout": timeout, "env": env or {}, "folder": folder, **paths}) + "\n"
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
