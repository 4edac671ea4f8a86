import pytest

from shim import settings


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    for variable in ("SHIM_DISABLE", "SHIM_FORCE", "SHIM_STRICT", "SHIM_PROBE"):
        monkeypatch.delenv(variable, raising=False)
