"""One way to write a version range, lower bound first, wherever the shim shows one: the status reasons,
the records, doctor, the tables; and the patches declare theirs that way. One way to write a run of
numbers, too: the layers ``shim.in_effect`` lists, the exit report's ranks, the audit's names."""

import pytest
from packaging.specifiers import SpecifierSet

import shim
from shim import Registry
from shim.ranges import runs, version_range
from tests.engine.fakes import make_patch

pytestmark = pytest.mark.any_version


@pytest.mark.parametrize(
    "given, written",
    [
        ("<6,>=5.23", ">=5.23,<6"),
        (SpecifierSet(">=5.16,<5.23"), ">=5.16,<5.23"),  # a SpecifierSet prints "<5.23,>=5.16"
        (" >= 5.0 ", ">=5.0"),
        ("!=5.1,<6,>=5", ">=5,<6,!=5.1"),
        ("<0.19.3", "<0.19.3"),
        ("", ""),
        ("not a range", "not a range"),
    ],
)
def test_a_range_is_written_lower_bound_first(given, written):
    assert version_range(given) == written
    if written and written != "not a range":  # the same versions, only written another way
        assert SpecifierSet(written) == SpecifierSet(str(given))


def test_every_patch_declares_its_ranges_as_they_are_written():
    for name in shim.registry.names:
        patch = shim.registry.patch(name)
        assert patch.requires == version_range(patch.requires), name
        for target in patch.targets:
            if target.requirement is not None:
                spec = target.requires[len(target.requirement.name) :]
                assert spec == version_range(spec), (name, target.spec)


def test_the_status_writes_a_range_as_the_patches_do(fake_modules):
    pkg = fake_modules(target="def f():\n    return 1\n")  # an installed distribution 1.2.0
    registry = Registry([make_patch(pkg, "target:f", requires="<2,>=1.0", name="ranged")])
    registry.activate()
    (record,) = registry.status()
    assert record.requires == f"{pkg}>=1.0,<2"
    assert f"{pkg} 1.2.0 is inside >=1.0,<2" in record.reason


@pytest.mark.parametrize(
    "numbers, written",
    [
        ([0, 1, 2, 3], ["0-3"]),
        ([3], ["3"]),
        ([0, 2], ["0", "2"]),
        ([0, 1, 3], ["0-1", "3"]),
        ([], []),
        ([3, 2], ["3", "2"]),
    ],
)
def test_a_run_of_numbers_is_written_first_to_last_and_read_the_same_everywhere(numbers, written):
    """In the order given (a run is consecutive and rising); each caller adds only its punctuation."""
    from shim import audit
    from shim.tools import render, report

    assert runs(numbers) == written
    assert render.spans([f"model.layers.{n}" for n in numbers]) == ", ".join(f"model.layers.{w}" for w in written)
    if numbers == sorted(set(numbers)) and numbers:
        assert report.rank_list(numbers) == f"rank{'s' if len(numbers) > 1 else ''} {', '.join(written)}"
        braced = ",".join(w.replace("-", "..") for w in written)
        assert (
            audit.grouped([f"a.{n}.w" for n in numbers]) == f"a.{braced if len(numbers) == 1 else '{' + braced + '}'}.w"
        )
