"""Throwaway patches for the engine's tests: a target module's source, a patch that tags what its
targets return, and readers of the registry's state and the shim's layers."""

import shim
from shim import Evidence, Patch, Target

TARGET = """
def f(x):
    return x

def g(x):
    return -x
"""


def tagging(tag):
    def wrapper(wrapped, instance, args, kwargs):
        return (tag, wrapped(*args, **kwargs))

    return wrapper


def make_patch(pkg, *paths, name="demo", requires=">=1.0", check=None, **extra):
    paths = paths or ("target:f",)
    targets = tuple(Target(f"{pkg}.{path}", tagging(name), check=check) for path in paths)
    return Patch(name=name, summary="demo", distribution=pkg, requires=requires, targets=targets, **extra)


def finds(present, detail="the demo's case"):
    """A bug probe (``Patch.bug_probe``) that answers ``present``."""
    return lambda: Evidence(present, detail)


def shim_layers(obj):
    return [layer for _name, layer in shim.wrappers(obj)]


def state(registry, name="demo"):
    return next((s.state, s.reason) for s in registry.status() if s.name == name)
