"""What the tests read of the engine's state that shipped code never asks: where a patch's part
sits, and when the import watchers are done."""

import time

import wrapt

from shim import importhooks
from shim.wrapping import patch_names_of


def shim_wrapper(obj: object, name: str):
    """The shim's layer in ``obj``'s wrapper chain if patch ``name`` has a part in it, or ``None``."""
    return wrapt.find_wrapper(obj, predicate=lambda entry: name in patch_names_of(entry))


def watchers_done(timeout: float = 10.0) -> bool:
    """Wait until no module's import is watched by a thread; whether that happened within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    watchers = importhooks._watchers
    while watchers and time.monotonic() < deadline:
        for watcher in list(watchers.values()):  # a copy made without releasing the GIL
            watcher.join(max(0.0, deadline - time.monotonic()))
    return not watchers
