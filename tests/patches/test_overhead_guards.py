"""Guards for the speed-ups that ``benchmarks/overhead.py`` led to: same behaviour, less cost.

Nothing here is timed; the benchmark measures, these tests keep the faster code equivalent.
"""

import pytest
import torch

from shim import Target
from shim.patches.load_keeps_requires_grad import _submodule
from tests.conftest import run_python


class Shadowed(torch.nn.Module):
    """A registered submodule ``base`` that ``getattr`` does not reach: a class property wins."""

    def __init__(self):
        super().__init__()
        self.other = torch.nn.Linear(2, 2)
        self.base = torch.nn.Sequential(torch.nn.Linear(2, 2))  # lands in _modules["base"]
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(3)])

    @property
    def base(self):  # noqa: F811 - the point of the test
        return self.other


class Tree(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Shadowed()


@pytest.mark.parametrize("path", ["model", "model.other", "model.layers.2.0", "model.base", "model.layers"])
def test_submodule_walk_finds_what_get_submodule_finds(path):
    tree = Tree()
    assert tree.model._modules["base"] is not tree.model.base  # the shadowing is real
    assert _submodule(tree, path) is tree.get_submodule(path)


@pytest.mark.parametrize("path", ["model.nope", "model.layers.7", "model.forward", "model.training"])
def test_submodule_walk_fails_like_get_submodule(path):
    tree = Tree()
    with pytest.raises(AttributeError) as expected:
        tree.get_submodule(path)
    with pytest.raises(AttributeError) as got:
        _submodule(tree, path)
    assert str(got.value) == str(expected.value)


def test_target_requirements_parse_without_packaging_requirements():
    target = Target("pkg.mod:f", lambda w, i, a, k: w(*a, **k), requires=" trl >= 0.26 ")
    assert (target.requirement.name, str(target.requirement.specifier)) == ("trl", ">=0.26")
    assert Target("pkg.mod:f", lambda w, i, a, k: w(*a, **k), requires="fake0_12").requirement.specifier.contains("9")
    for bad in ("trl[extra]>=1", "trl>=1; python_version>'3'", ">=1", "trl>="):
        with pytest.raises(ValueError, match="is not a requirement like 'trl>=0.26'"):
            Target("pkg.mod:f", lambda w, i, a, k: w(*a, **k), requires=bad)


def test_import_shim_skips_modules_it_only_needs_for_warnings():
    code = """
    import sys
    import shim
    print(sorted(m for m in ("packaging.requirements", "packaging.markers", "difflib") if m in sys.modules))
    """
    assert run_python(code).stdout.strip() == "[]"
