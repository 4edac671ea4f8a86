"""The test device from one switch (tests/devices.py, read by tests/conftest.py): what it accepts, what
each device gets (its variants, tolerances, compile backends), and that a CPU run stays as it was."""

import types

import pytest
import torch

from tests import conftest, devices

pytestmark = pytest.mark.any_version  # the suite's own machinery, whatever is installed


def test_the_switch_defaults_to_the_cpu_and_the_option_wins_over_the_variable():
    assert devices.chosen(None, {}) == "cpu"
    assert devices.chosen(None, {devices.VARIABLE: ""}) == "cpu"
    assert devices.chosen(None, {devices.VARIABLE: " CUDA "}) == "cuda"
    assert devices.chosen("cpu", {devices.VARIABLE: "cuda"}) == "cpu"


@pytest.mark.parametrize(
    "option, environ, named", [(None, {devices.VARIABLE: "gpu"}, devices.VARIABLE), ("mps", {}, "--device")]
)
def test_an_unknown_device_is_refused_with_the_valid_ones(option, environ, named):
    with pytest.raises(ValueError, match=f"^{named}=.* is not a test device; use one of cpu, cuda$"):
        devices.chosen(option, environ)


def fake_config(option):
    return types.SimpleNamespace(getoption=lambda name: option)


def test_pytest_refuses_a_bad_switch_and_cuda_where_torch_sees_none(monkeypatch):
    monkeypatch.setenv(devices.VARIABLE, "cpu")
    with pytest.raises(pytest.UsageError, match="is not a test device"):
        conftest.pytest_configure(fake_config("tpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.UsageError, match="the test device is cuda, and torch .* sees no CUDA device"):
        conftest.pytest_configure(fake_config("cuda"))
    conftest.pytest_configure(fake_config(None))
    assert devices.chosen() == "cpu"


class Metafunc:
    """What ``pytest_generate_tests`` reads of a test, and what it asks to parametrize."""

    def __init__(self, marked, fixtures=("device",)):
        self.fixturenames = list(fixtures)
        self.definition = types.SimpleNamespace(get_closest_marker=lambda name: object() if marked else None)
        self.parametrized = []

    def parametrize(self, name, values, ids):
        self.parametrized.append((name, [ids(value) for value in values]))


def test_an_autocast_test_runs_once_on_a_cpu_and_also_under_bf16_on_cuda(monkeypatch):
    monkeypatch.setenv(devices.VARIABLE, "cpu")
    for marked, fixtures in ((True, ("device",)), (False, ("device",)), (True, ("other",))):
        metafunc = Metafunc(marked, fixtures)
        conftest.pytest_generate_tests(metafunc)
        assert metafunc.parametrized == []  # on a CPU: one run, the test's name unchanged
    monkeypatch.setenv(devices.VARIABLE, "cuda")
    marked, plain = Metafunc(True), Metafunc(False)
    conftest.pytest_generate_tests(marked)
    conftest.pytest_generate_tests(plain)
    assert marked.parametrized == [("device", ["cuda", "cuda-bf16"])]
    assert plain.parametrized == []


def test_each_device_reads_its_own_stated_tolerance_and_a_cpu_keeps_the_suites():
    stated = devices.Tolerances(cpu=(1e-5, 1e-6), cuda=(1e-4, 1e-5), bf16=(5e-2, 1e-2))
    assert devices.Device().tolerance(stated) == {"rtol": 1e-5, "atol": 1e-6}
    assert devices.Device("cuda").tolerance(stated) == {"rtol": 1e-4, "atol": 1e-5}
    assert devices.Device("cuda", bf16=True).tolerance(stated) == {"rtol": 5e-2, "atol": 1e-2}
    # the CPU figure is tests.steps.wrong_grads' default, which the suite always used
    assert devices.CPU.tolerance() == {"rtol": 1e-5, "atol": 1e-6}


def test_a_cpu_device_leaves_tensors_and_modules_as_they_are():
    tensor, module = torch.zeros(2), torch.nn.Linear(2, 2)
    assert devices.CPU.put(tensor) is tensor and devices.CPU.put(module) is module
    with devices.CPU.autocast():
        assert not torch.is_autocast_enabled("cpu")
    with devices.Device("cpu", bf16=True).autocast():  # bf16 autocast exists on a CPU too
        assert (module(tensor)).dtype == torch.bfloat16
    assert [str(device) for device in devices.variants("cpu")] == ["cpu"]
    assert [str(device) for device in devices.variants("cuda")] == ["cuda", "cuda-bf16"]


def test_inductor_joins_the_compile_tests_on_cuda_and_where_a_cpu_opts_in():
    assert devices.backends("cpu", set()) == ["eager", "aot_eager"]
    assert devices.backends("cpu", devices.opt_in({"DO_NO_HARM": "full, inductor"})) == [
        "eager",
        "aot_eager",
        "inductor",
    ]
    assert devices.backends("cuda", set()) == ["eager", "aot_eager", "inductor"]
    assert devices.opt_in({}) == set()


def test_the_workflows_fresh_interpreters_get_the_switch_and_no_other_shim_variable(monkeypatch):
    monkeypatch.setenv(devices.VARIABLE, "cpu")
    monkeypatch.setenv("SHIM_DISABLE", "all")
    clean = conftest.clean_environment()
    assert clean[devices.VARIABLE] == "cpu" and "SHIM_DISABLE" not in clean
