import pytest

import shim
from shim import runtime


@pytest.fixture
def ledger():
    """What each patch counted in this test, from an empty ledger: ``ledger(name)`` is the patch's
    ``(effects, last_effect)`` as ``shim.status()`` reports them."""
    runtime.clear()
    yield lambda name: next((s.effects, s.last_effect) for s in shim.status() if s.name == name)
    runtime.clear()
