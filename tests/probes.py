"""A patch's bug probe asked in the tests as ``python -m shim doctor`` asks it (``Patch.bug_probe``)."""

import shim
from shim.tools import doctor


def bug_found(name: str) -> bool:
    """Whether patch ``name``'s bug probes find its bug now (one that could not run fails the test)."""
    answers = doctor.ask(shim.registry.patch(name))
    assert answers, f"{name}: no bug probe of it could be asked here"
    failed = [answer.error for answer in answers if answer.present is None]
    assert not failed, failed
    return any(answer.present for answer in answers)
