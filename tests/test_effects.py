"""The effects ledger: each patch counts what it changed (never what it passed through), says so once
in the log, and the counts reach ``shim.status()``, ``shim.report()`` and ``SHIM_REPORT=1``."""

import importlib.util
import itertools
import logging
import tempfile

import pytest
import torch
import transformers

import shim
from shim import runtime as effects
from shim.patches._checkpointing import disable, enable
from shim.selfcheck.models import frozen_llama_class, tiny_llama_config
from shim.selfcheck.steps import enable_checkpointing, keyword_driven_grads
from tests.checkpointing_cases import TRANSFORMERS, configure, quietly, tiny_llama
from tests.conftest import run_python

HAS_TRL = importlib.util.find_spec("trl") is not None


@pytest.fixture(autouse=True)
def empty_ledger():
    effects.clear()
    yield
    effects.clear()


def ledger(name: str) -> tuple[int, str]:
    record = next(s for s in shim.status() if s.name == name)
    return record.effects, record.last_effect


@pytest.mark.skipif(TRANSFORMERS.major < 5, reason="version rule: loading resets requires_grad from transformers 5.0")
def test_load_counts_each_parameter_kept_frozen():
    model_class = frozen_llama_class()
    model = model_class(tiny_llama_config())
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        transformers.LlamaForCausalLM.from_pretrained(directory)  # nothing frozen: nothing to keep
        assert ledger("load-keeps-requires-grad") == (0, "")
        model_class.from_pretrained(directory)
    frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    assert ledger("load-keeps-requires-grad") == (
        frozen,
        f"kept {frozen} parameter(s) of FrozenBaseLlama frozen that transformers {transformers.__version__} "
        "made trainable while loading",
    )


def test_checkpointing_restore_counts_restored_configurations_only():
    model = tiny_llama()
    configure(model, None)  # transformers' defaults: a cycle changes nothing
    quietly(disable, model)
    quietly(enable, model, None)
    assert ledger("checkpointing-restore") == (0, "")

    configure(model, {"use_reentrant": True, "preserve_rng_state": False})
    quietly(disable, model)
    quietly(enable, model, None)
    count, last = ledger("checkpointing-restore")
    assert count == 1
    assert last.startswith("LlamaForCausalLM was re-enabled without a configuration: transformers reset it to ")
    modules = sum(1 for module in model.modules() if hasattr(module, "gradient_checkpointing"))
    assert last.endswith(
        f"the shim restored {{'use_reentrant': True, 'preserve_rng_state': False}} on {modules} module(s)"
    )


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
def test_trl_restore_on_error_counts_the_restore_after_an_exception():
    import accelerate
    from trl.models.utils import unwrap_model_for_generation

    model = tiny_llama()
    configure(model, {"use_reentrant": False})
    accelerator = accelerate.Accelerator(cpu=True)
    with unwrap_model_for_generation(model, accelerator):
        pass
    assert ledger("trl-restore-on-error") == (0, "")
    with pytest.raises(KeyError):
        with unwrap_model_for_generation(model, accelerator):
            raise KeyError("bad sample")
    assert ledger("trl-restore-on-error") == (
        1,
        "KeyError raised inside trl's unwrap_model_for_generation on LlamaForCausalLM, which trl leaves "
        "without checkpointing; the shim re-enabled gradient checkpointing",
    )


@pytest.mark.skipif(not HAS_TRL or importlib.util.find_spec("trl.models.utils") is None, reason="trl is not installed")
def test_call_signature_counts_calls_trl_would_have_broken():
    from trl.models import utils as trl_utils

    if not hasattr(trl_utils, "disable_gradient_checkpointing"):
        pytest.skip("version rule: disable_gradient_checkpointing exists from trl 0.26")

    class KeywordOnly(transformers.LlamaForCausalLM):
        def gradient_checkpointing_enable(self, *, gradient_checkpointing_kwargs=None):
            quietly(super().gradient_checkpointing_enable, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    plain = tiny_llama()
    configure(plain, {"use_reentrant": False})
    with quietly(trl_utils.disable_gradient_checkpointing, plain, {"use_reentrant": False}):
        pass
    assert ledger("checkpointing-call-signature") == (0, "")

    model = KeywordOnly(tiny_llama_config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with quietly(trl_utils.disable_gradient_checkpointing, model, {"use_reentrant": False}):
        pass
    count, last = ledger("checkpointing-call-signature")
    # From 5.23 the re-enable goes through activation_checkpointing_enable, which hands every_n_layers
    # and offload to the keyword-only override: the patch leaves them out, a second effect.
    assert count == (2 if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable") else 1)
    assert last.startswith("re-enabled checkpointing on KeywordOnly through its signature ")
    assert "would have passed {'use_reentrant': False} positionally and raised TypeError" in last


def test_kwargs_clean_counts_configurations_it_cleaned():
    model = tiny_llama()
    configure(model, {"use_reentrant": True})
    assert ledger("checkpoint-kwargs-clean") == (0, "")
    configure(model, {"use_reentrant": True, "selective": False})
    assert ledger("checkpoint-kwargs-clean") == (
        1,
        "took selective out of the checkpointing kwargs of LlamaForCausalLM, which transformers would pass "
        "to torch.utils.checkpoint; every_n_layers/offload became the parameters they are",
    )


@pytest.mark.skipif(TRANSFORMERS.major < 5, reason="version rule: hooks pile up from transformers 5.0")
def test_hook_dedupe_counts_hooks_it_removed():
    model = tiny_llama()
    configure(model, {"use_reentrant": False})
    assert ledger("input-grad-hook-dedupe") == (0, "")
    for _ in range(3):
        quietly(disable, model)
        quietly(enable, model, {"use_reentrant": False})
    count, last = ledger("input-grad-hook-dedupe")
    assert count == 3
    assert last.startswith("removed 1 input-require-grads hook(s) that LlamaForCausalLM still held")


def test_reentrant_keyword_grads_counts_diverted_layer_calls_only():
    torch.manual_seed(0)
    model = tiny_llama(layers=3)
    model.train()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8))
    quietly(enable_checkpointing, model, {"use_reentrant": False})
    quietly(keyword_driven_grads, model, input_ids)
    assert ledger("reentrant-keyword-grads") == (0, "")
    quietly(enable_checkpointing, model, {"use_reentrant": True})
    quietly(keyword_driven_grads, model, input_ids)
    count, last = ledger("reentrant-keyword-grads")
    assert count == 3, "one per decoder layer call"
    assert last.startswith("passed 1 grad-requiring keyword tensor(s) (hidden_states) of LlamaDecoderLayer")


def test_the_first_effect_of_each_patch_is_logged_once_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="shim"):
        for _ in range(3):
            effects.record("demo-patch", "kept %d thing(s) of %s", 2, "Model")
    lines = [r for r in caplog.records if r.name == "shim"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage().startswith("demo-patch: kept 2 thing(s) of Model (first effect in this process")
    assert (effects.count("demo-patch"), effects.last("demo-patch")) == (3, "kept 2 thing(s) of Model")


def test_report_lists_what_changed_and_what_did_not():
    model = tiny_llama()
    configure(model, {"use_reentrant": True, "selective": False})
    text = shim.report()
    assert text.splitlines()[0].startswith("hf-train-shim report (pid ")
    assert text.splitlines()[0].endswith(f": 1 of {len(shim.status())} patches changed something")
    lines = text.splitlines()
    row = lines.index("  checkpoint-kwargs-clean        1")
    assert lines[row + 1].startswith("      last effect: took selective out of the checkpointing kwargs")
    assert max(len(line) for line in lines) <= 100


TRAINING_SCRIPT = """
import shim
import tempfile, torch
from shim.selfcheck.models import frozen_llama_class
from shim.selfcheck.models import quiet_transformers, tiny_llama_config
quiet_transformers()
model_class = frozen_llama_class()
with tempfile.TemporaryDirectory() as directory:
    model_class(tiny_llama_config()).save_pretrained(directory)
    model = model_class.from_pretrained(directory)
model.train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True, "preserve_rng_state": False})
model.gradient_checkpointing_disable()
model.gradient_checkpointing_enable()  # as trl does around generation
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
ids = torch.randint(0, 64, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
print("trained")
"""


@pytest.mark.skipif(TRANSFORMERS.major < 5, reason="version rule: the load effect needs transformers 5.x")
def test_a_training_script_reports_its_effects_at_exit_and_logs_the_first_ones():
    reported = run_python(TRAINING_SCRIPT, env={"SHIM_REPORT": "1", "RANK": "1"})
    assert "trained" in reported.stdout
    report = reported.stderr[reported.stderr.index("[rank 1] hf-train-shim report (pid ") :].splitlines()
    assert all(line.startswith("[rank 1] ") for line in report)
    assert max(len(line) for line in report) <= 100, "the [rank 1] prefix included"
    rows = [line.removeprefix("[rank 1] ") for line in report]

    def last_effect(row: str) -> str:  # the wrapped lines below a patch's row, joined again
        below = rows[rows.index(row) + 1 :]
        return " ".join(line.strip() for line in itertools.takewhile(lambda line: line.startswith(" " * 6), below))

    assert last_effect("  load-keeps-requires-grad       10") == (
        f"last effect: kept 10 parameter(s) of FrozenBaseLlama frozen that transformers {transformers.__version__} "
        "made trainable while loading"
    )
    assert last_effect("  checkpointing-restore           1").startswith(
        "last effect: FrozenBaseLlama was re-enabled without a configuration"
    )

    logged = run_python(TRAINING_SCRIPT, env={"SHIM_LOG_LEVEL": "INFO"}).stderr
    assert "shim INFO: load-keeps-requires-grad: kept 1 parameter(s) of FrozenBaseLlama frozen" in logged
    assert "shim INFO: checkpointing-restore: FrozenBaseLlama was re-enabled without a configuration" in logged
    assert logged.count("load-keeps-requires-grad: kept") == 1, "logged once, counted always"
    assert "hf-train-shim report" not in logged
