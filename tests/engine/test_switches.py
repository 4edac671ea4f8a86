"""Every switch does what it says, or says why not: environment variables, the Python API, status."""

import importlib
import json
import warnings

import pytest

from shim import APPLIED, DISABLED, SKIPPED, Registry, ShimWarning, settings
from tests.conftest import run_python
from tests.engine.fakes import TARGET, make_patch, state
from tests.tools.test_import_and_cli import LOAD_BUG

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


@pytest.fixture(autouse=True)
def fresh_environment(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    for variable in ("SHIM_DISABLE", "SHIM_FORCE", "SHIM_STRICT", "SHIM_LOG_LEVEL", "SHIM_REPORT"):
        monkeypatch.delenv(variable, raising=False)


def three(pkg):
    return Registry(
        [
            make_patch(pkg, name="first-patch"),
            make_patch(pkg, "target:g", name="second-patch"),
            make_patch(pkg, "target:g", name="third-patch"),
        ]
    )


# -- SHIM_DISABLE / SHIM_FORCE ---------------------------------------------------------------------


def test_every_known_name_is_honoured_whatever_the_others(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", "FIRST_patch, nonsense-patch, second_patch, rm -rf")
    registry = three(pkg)
    with pytest.warns(ShimWarning) as caught:
        registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1 and module.g(1) == ("third-patch", -1)
    assert state(registry, "first-patch") == (DISABLED, "opted out with SHIM_DISABLE=first-patch")
    assert state(registry, "second-patch")[0] == DISABLED
    messages = [str(w.message) for w in caught]
    assert any("unknown patch 'nonsense-patch', ignored; did you mean" in m for m in messages)
    assert any("'rm -rf' is not a patch name, ignored" in m and "first-patch" in m for m in messages)


def test_force_accepts_module_style_names(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    monkeypatch.setenv("SHIM_FORCE", "Gated_Patch")
    registry = Registry([make_patch(pkg, name="gated-patch", requires=">=9")])
    registry.activate()
    assert module.f(1) == ("gated-patch", 1)
    assert "applied anyway because of SHIM_FORCE" in state(registry, "gated-patch")[1]


def test_warnings_point_at_the_users_code_not_at_the_shim(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", "nonsense-patch")
    registry = three(pkg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry.activate()  # read on activation: this line
        settings._warned.clear()
        importlib.import_module(f"{pkg}.target")  # read again when the target applies, inside the import
    assert [w.filename for w in caught if w.category is ShimWarning] == [__file__, __file__]


def test_a_bad_flag_warns_with_the_valid_values(monkeypatch):
    monkeypatch.setenv("SHIM_STRICT", "maybe")
    with pytest.warns(ShimWarning, match="SHIM_STRICT='maybe' is not valid; use one of 0, 1, false, no, off, on"):
        assert settings.read(()).strict is False


KNOWN = ("first-patch", "second-patch")


@pytest.mark.parametrize("value", ["all,", "all, ", "1,", "true,", " * ,", ",ALL", "first_patch, all", "all,,none"])
def test_all_inside_a_list_disables_everything_without_a_warning(monkeypatch, value):
    monkeypatch.setenv("SHIM_DISABLE", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings.read(KNOWN).disable_all is True


@pytest.mark.parametrize(
    ("value", "names"),
    [("first-patch,,", {"first-patch"}), (",first_patch,", {"first-patch"}), (",,", set()), (" , 0 ,", set())],
)
def test_empty_items_of_a_list_are_ignored_everywhere(monkeypatch, value, names):
    monkeypatch.setenv("SHIM_DISABLE", value)
    monkeypatch.setenv("SHIM_FORCE", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = settings.read(KNOWN)
    assert (config.disable_all, config.disabled, config.forced) == (False, names, names)


@pytest.mark.parametrize(
    "value",
    ["", "first-step-audit", " First_Step_Audit ,", "first-patch", "first-patch,first-step-audit", "all", ",*,", "0"],
)
def test_the_audits_switch_and_all_are_read_as_the_settings_read_shim_disable(monkeypatch, value):
    """``SHIM_DISABLE`` has one reader: the audit's switch and ``all`` (the packs' silence) answer as
    :func:`settings.read` does, which alone warns about a bad value."""
    monkeypatch.setenv("SHIM_DISABLE", value)
    config = settings.read(KNOWN)
    assert settings.audit_switched_off() == (config.disable_all or settings.AUDIT in config.disabled)
    assert settings.all_disabled() == config.disable_all


def test_force_takes_no_all(monkeypatch):
    monkeypatch.setenv("SHIM_FORCE", "all,first-patch")
    with pytest.warns(ShimWarning, match="SHIM_FORCE: 'all' is not accepted, ignored; SHIM_FORCE takes patch names"):
        assert settings.read(KNOWN).forced == {"first-patch"}


# -- the Python API ------------------------------------------------------------------------------


def test_status_says_suspended_inside_shim_disabled(fake_modules):
    """A ``shim.disabled()`` block suspends a patch: its state stays, its layers are off."""
    pkg = fake_modules(target=TARGET)
    registry = three(pkg)
    registry.activate()
    importlib.import_module(f"{pkg}.target")

    def suspended():
        return {s.name for s in registry.status() if s.suspended}

    with registry.disabled("first-patch"):
        assert suspended() == {"first-patch"}
        assert not registry.is_on("first-patch") and registry.is_on("second-patch")
        with registry.disabled():
            assert suspended() == {"first-patch", "second-patch", "third-patch"}
            assert {s.state for s in registry.status()} == {APPLIED}
        assert suspended() == {"first-patch"}
    assert suspended() == set()
    assert {s.state for s in registry.status()} == {APPLIED}
    assert all(registry.is_on(name) for name in registry.names)


def test_enable_after_deactivate_applies_that_patch_again(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = three(pkg)
    registry.activate()
    registry.deactivate()
    assert module.f(1) == 1 and state(registry, "first-patch")[0] == DISABLED

    registry.enable("first-patch")

    assert module.f(1) == ("first-patch", 1)
    assert state(registry, "first-patch")[0] == APPLIED
    assert module.g(1) == -1, "only the named patch: the others stay deactivated"
    assert state(registry, "second-patch") == (DISABLED, "shim.deactivate() was called")


def test_an_explicit_enable_survives_deactivate_and_activate(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    monkeypatch.setenv("SHIM_DISABLE", "first-patch")
    registry = three(pkg)
    registry.activate()
    assert module.f(1) == 1
    registry.enable("first-patch")
    registry.deactivate()
    registry.activate()
    assert module.f(1) == ("first-patch", 1) and state(registry, "first-patch")[0] == APPLIED
    registry.disable("first-patch")  # until it is switched off again
    registry.deactivate()
    registry.activate()
    assert module.f(1) == 1


def test_a_distribution_that_is_not_installed_is_skipped_not_pending(fake_modules):
    registry = Registry([make_patch("not_installed_anywhere", "target:f", name="absent-patch")])
    registry.activate()
    assert state(registry, "absent-patch") == (SKIPPED, "not_installed_anywhere is not installed")


def test_disabled_rows_still_show_the_installed_version(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", "all")
    registry = three(pkg)
    registry.activate()
    assert {(s.state, s.installed) for s in registry.status()} == {(DISABLED, "1.2.0")}


# -- SHIM_LOG_LEVEL, in a fresh interpreter --------------------------------------------------------


@pytest.mark.parametrize("level", ["INFO", "debug"])
def test_shim_log_level_shows_the_shims_log_lines_on_stderr(level):
    code = "import shim\nimport transformers.modeling_utils"
    stderr = run_python(code, env={"SHIM_LOG_LEVEL": level}, torch_first=True).stderr
    assert "shim INFO: checkpointing-restore: applied (transformers" in stderr
    assert ("shim DEBUG: " in stderr) == (level == "debug")


def test_without_shim_log_level_the_shim_prints_nothing():
    assert run_python("import shim\nimport transformers.modeling_utils", torch_first=True).stderr == ""


def test_after_disable_deactivate_activate_the_reason_is_still_disable(fake_modules):
    pkg = fake_modules(target=TARGET)
    importlib.import_module(f"{pkg}.target")
    registry = three(pkg)
    registry.activate()
    registry.disable("first-patch")
    registry.deactivate()
    registry.activate()
    assert state(registry, "first-patch") == (DISABLED, "switched off with shim.disable()")
    assert state(registry, "second-patch")[0] == APPLIED


# -- names, as SHIM_DISABLE takes them -------------------------------------------------------------


def test_the_python_api_takes_names_as_the_environment_does(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = three(pkg)
    registry.activate()
    registry.disable("First_Patch")
    assert module.f(1) == 1 and not registry.is_on("FIRST-PATCH") and not registry.switch_of("first_patch")
    registry.enable(" first_PATCH ")
    assert module.f(1) == ("first-patch", 1) and registry.is_on("First-Patch")
    with registry.disabled("SECOND_patch"):
        assert module.g(1) == ("third-patch", -1)
    assert registry.patch("third_patch").name == "third-patch"


@pytest.mark.parametrize(
    "name, message",
    [
        ("frist-patch", "no patch named 'frist-patch'; did you mean first-patch, third-patch, second-patch?"),
        ("nothing-like-it", "no patch named 'nothing-like-it'; python -m shim lists them"),
        ("x" * 300, "no patch named 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...'; python -m shim lists them"),
        ("First_Step_Audit", "the first-step audit is no patch: SHIM_DISABLE=first-step-audit switches it off"),
    ],
)
def test_an_unknown_name_raises_a_short_key_error_with_the_closest_names(fake_modules, name, message):
    registry = three(fake_modules(target=TARGET))

    def within_disabled(name):
        with registry.disabled(name):
            pass

    for call in (registry.disable, registry.enable, within_disabled, registry.is_on, registry.switch_of):
        with pytest.raises(KeyError) as caught:
            call(name)
        assert caught.value.args == (message,)
        assert len(f"KeyError: {str(caught.value)}") <= 100


def test_an_unknown_name_in_the_real_catalogue_gets_a_short_message():
    import shim

    with pytest.raises(KeyError) as caught:
        shim.disable("checkpointing_restor")
    (message,) = caught.value.args
    assert message.startswith("no patch named 'checkpointing_restor'; did you mean checkpointing-restore")
    assert len(f"KeyError: {str(caught.value)}") <= 100


# -- deactivate() takes the shim's finder out of sys.meta_path ---------------------------------------


def test_deactivate_removes_the_shims_finder_and_activate_puts_it_back_first():
    code = """
    import sys
    import shim
    where = lambda: [i for i, finder in enumerate(sys.meta_path) if type(finder).__module__.startswith("shim.")]
    print(where())
    shim.deactivate()
    print(where())
    shim.enable("load-keeps-requires-grad")  # one patch on: its hooks wait, so the finder is back
    print(where())
    shim.deactivate()
    sys.meta_path.insert(0, sys.meta_path.pop())  # someone else's finder first, for a change
    shim.activate()
    print(where())
    import transformers.modeling_utils
    print({s.name: s.state for s in shim.status()}["load-keeps-requires-grad"])
    """
    assert run_python(code, torch_first=True).stdout.split() == [
        "[0]",
        "[]",
        "[0]",
        "[0]",
        "applied" if LOAD_BUG else "skipped",
    ]


# -- the log agrees with the status ------------------------------------------------------------------

LOG_AND_STATUS = """
import json, logging, re
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("shim").addHandler(Keep())
import shim
{then}
last = {{}}
for level, message in records:
    name, _, rest = message.partition(": ")
    last[name] = re.sub(r"^applied to .* as well \\(", "applied (", rest)  # a later target module
print(json.dumps({{"records": records, "last": last,
                  "status": {{s.name: f"{{s.state}} ({{s.reason}})" for s in shim.status()}}}}))
"""


@pytest.mark.parametrize("then", ["pass", "import transformers.modeling_utils"])
def test_the_last_log_line_of_each_patch_says_what_the_status_says(then):
    out = json.loads(
        run_python(LOG_AND_STATUS.format(then=then), env={"SHIM_LOG_LEVEL": "DEBUG"}, torch_first=True).stdout
    )
    assert out["last"] == out["status"], out["records"]
    applied = [m for level, m in out["records"] if level == "INFO" and ": applied (" in m]
    assert len(applied) == len({m.split(":")[0] for m in applied}), "INFO says 'applied' once per patch"


@pytest.mark.parametrize("value", ["all", "1", "true", "*", "ALL"])
def test_shim_disable_all(fake_modules, monkeypatch, value):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", value)
    registry = Registry([make_patch(pkg)])
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1
    assert state(registry) == (DISABLED, "opted out with SHIM_DISABLE=all")


def test_shim_disable_list_and_explicit_enable(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", " demo , other")
    registry = Registry(
        [make_patch(pkg), make_patch(pkg, "target:g", name="other"), make_patch(pkg, "target:g", name="third")]
    )
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1
    assert module.g(1) == ("third", -1)
    assert state(registry) == (DISABLED, "opted out with SHIM_DISABLE=demo")
    registry.enable("demo")  # the API is explicit and wins over the environment
    assert module.f(1) == ("demo", 1)


def test_unknown_patch_name_warns_once_with_the_closest_names(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", "dmeo")
    registry = Registry([make_patch(pkg)])
    with pytest.warns(ShimWarning, match="unknown patch 'dmeo', ignored; did you mean demo"):
        registry.activate()
    importlib.import_module(f"{pkg}.target")  # read again on apply: no second warning
    assert len(settings._warned) == 1


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        (
            "SHIM_DISABLE",
            "demo;rm -rf",
            "'demo;rm -rf' is not a patch name, ignored; SHIM_DISABLE takes 'all' or a comma",
        ),
        ("SHIM_STRICT", "maybe", "use one of"),
        ("SHIM_LOG_LEVEL", "LOUD", "use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ],
)
def test_invalid_values_warn_list_the_valid_ones_and_use_the_default(
    fake_modules, monkeypatch, variable, value, expected
):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv(variable, value)
    registry = Registry([make_patch(pkg)])
    with pytest.warns(ShimWarning, match=expected):
        settings.configure_logging()
        registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == ("demo", 1)  # the default: applied, not strict
