"""The pack's own test: run it where the pack is installed (pip install . && pytest)."""

from shim_example_pack import losses
from shim_example_pack.fixes import NAME

import shim


def test_the_shim_applies_the_pack_patch():
    (status,) = [s for s in shim.status() if s.name == NAME]
    assert status.state == "applied", status.reason
    assert status.provider == "shim-example-pack"


def test_the_bug_shows_with_the_patch_off_and_not_with_it_on():
    with shim.disabled(NAME):
        assert shim.registry.patch(NAME).self_check() is True
    assert shim.registry.patch(NAME).self_check() is False


def test_an_empty_window_is_zero_and_the_rest_is_upstream():
    assert losses.mean_loss([]) == 0.0
    assert losses.mean_loss([1.0, 3.0]) == 2.0
