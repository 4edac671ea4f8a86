"""peft-adapter-trainability on the installed peft: adding or loading an adapter keeps the others' flags.

Every bug test first shows the bug with the patch switched off on the installed peft, then the fix
with it on. The flags compared are ``{LoRA parameter name: requires_grad}`` of the whole model, exactly;
the rule they must follow is peft 0.21.0's (huggingface/peft#3495): the parameters that existed
before an adapter is added keep their flag, and the new adapter is trainable only when
``load_adapter(..., is_trainable=True)`` loaded it.
"""

import contextlib
import importlib.metadata
import os
import tempfile

import pytest
from packaging.version import Version

import shim
from shim import runtime as effects
from shim.tools.targets import quiet_transformers
from tests.probes import bug_found
from tests.tinymodels import lora_config, tiny_llama_config

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from peft import PeftModel, get_peft_model, inject_adapter_in_model  # noqa: E402

from shim.patches import peft_adapter_trainability as patch_module  # noqa: E402
from shim.patches.peft_adapter_trainability import expected_requires_grad, lora_requires_grad  # noqa: E402

NAME = "peft-adapter-trainability"
PEFT = Version(peft.__version__)
BUGGY = PEFT < Version("0.21")
needs_bug = pytest.mark.skipif(
    not BUGGY, reason="version rule: the bug exists up to peft 0.20 (fixed in 0.21.0 by huggingface/peft#3495)"
)
TRL = Version(importlib.metadata.version("trl"))
needs_use_adapter = pytest.mark.skipif(
    TRL < Version("0.27"),
    reason="version rule: trl.trainer.utils.use_adapter (the reference-adapter switch) exists from trl 0.27",
)
needs_dpo_ref_adapter = pytest.mark.skipif(
    TRL < Version("0.29"), reason="version rule: DPOTrainer adds a 'ref' adapter to a PEFT model from trl 0.29"
)
quiet_transformers()


@pytest.fixture(autouse=True)
def empty_ledger():
    effects.clear()
    yield
    effects.clear()


def ledger() -> tuple[int, str]:
    record = next(s for s in shim.status() if s.name == NAME)
    return record.effects, record.last_effect


def state() -> str:
    import peft.peft_model  # noqa: F401  (both target modules imported)

    return next(s for s in shim.status() if s.name == NAME).state


def base_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config())


@pytest.fixture(scope="module")
def saved():
    """Adapters saved once for the module: ``plain`` (q/v), ``other_targets`` (k/o), ``with_head`` (+ lm_head)."""
    with tempfile.TemporaryDirectory() as directory:
        configs = {
            "plain": lora_config(),
            "other_targets": lora_config(target_modules=["k_proj", "o_proj"]),
            "with_head": lora_config(modules_to_save=["lm_head"]),
        }
        for name, config in configs.items():
            get_peft_model(base_model(), config).save_pretrained(os.path.join(directory, name))
        yield {name: os.path.join(directory, name) for name in configs}


def loaded(path, trainable: bool):
    return PeftModel.from_pretrained(base_model(), path, is_trainable=trainable)


def base_flags(model) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters() if ".lora_" not in name}


def all_frozen(model) -> dict[str, bool]:
    return expected_requires_grad(model, set())


# -- the bug, then the fix ---------------------------------------------------------------------


@needs_bug
def test_patch_is_applied():
    assert state() == "applied"


@needs_bug
def test_loading_a_frozen_adapter_keeps_the_trainable_one_trainable(saved):
    with shim.disabled(NAME):
        upstream = get_peft_model(base_model(), lora_config())
        upstream.load_adapter(saved["plain"], adapter_name="other", is_trainable=False)
    assert lora_requires_grad(upstream) == all_frozen(upstream), "bug: every LoRA parameter is frozen"
    assert ledger() == (0, "")

    model = get_peft_model(base_model(), lora_config())
    model.load_adapter(saved["plain"], adapter_name="other", is_trainable=False)
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})
    assert not any(base_flags(model).values())
    assert ledger() == (
        1,
        f"kept 8 parameter(s) of adapter 'default' trainable that peft {peft.__version__} froze "
        "when adapter 'other' was added with inference_mode=True",
    )


@needs_bug
def test_adding_an_inference_mode_adapter_keeps_the_trainable_one_trainable():
    with shim.disabled(NAME):
        upstream = get_peft_model(base_model(), lora_config())
        upstream.add_adapter("other", lora_config(inference_mode=True))
    assert lora_requires_grad(upstream) == all_frozen(upstream), "bug: every LoRA parameter is frozen"

    model = get_peft_model(base_model(), lora_config())
    model.add_adapter("other", lora_config(inference_mode=True))
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})
    assert ledger()[0] == 1


@needs_bug
def test_loading_a_trainable_adapter_next_to_a_frozen_one_does_not_swap_them(saved):
    with shim.disabled(NAME):
        upstream = loaded(saved["plain"], trainable=False)
        upstream.load_adapter(saved["plain"], adapter_name="other", is_trainable=True)
    assert lora_requires_grad(upstream) == expected_requires_grad(upstream, {"default"}), "bug: swapped"

    model = loaded(saved["plain"], trainable=False)
    model.load_adapter(saved["plain"], adapter_name="other", is_trainable=True)
    assert lora_requires_grad(model) == expected_requires_grad(model, {"other"})
    assert not any(base_flags(model).values())
    # Two effects: the frozen adapter kept frozen, then the new one made trainable as asked.
    assert ledger() == (
        2,
        f"made 8 parameter(s) of adapter 'other' trainable, as load_adapter(is_trainable=True) asked; "
        f"peft {peft.__version__} left the new adapter frozen",
    )


@needs_bug
def test_loading_a_trainable_adapter_next_to_a_trainable_one_makes_it_trainable(saved):
    with shim.disabled(NAME):
        upstream = loaded(saved["plain"], trainable=True)
        upstream.load_adapter(saved["plain"], adapter_name="other", is_trainable=True)
    assert lora_requires_grad(upstream) == expected_requires_grad(upstream, {"default"}), "bug: 'other' frozen"

    model = loaded(saved["plain"], trainable=True)
    model.load_adapter(saved["plain"], adapter_name="other", is_trainable=True)
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default", "other"})
    assert ledger()[0] == 1


@needs_bug
def test_adding_an_adapter_to_a_frozen_model_keeps_it_frozen(saved):
    with shim.disabled(NAME):
        upstream = loaded(saved["plain"], trainable=False)
        upstream.add_adapter("other", lora_config())
    assert lora_requires_grad(upstream) == expected_requires_grad(upstream, {"default"}), "bug: unfrozen"

    model = loaded(saved["plain"], trainable=False)
    model.add_adapter("other", lora_config())
    # The new adapter is not active: peft 0.21 leaves it frozen too (add_adapter is not load_adapter).
    assert lora_requires_grad(model) == all_frozen(model)
    assert ledger() == (
        1,
        f"kept 8 parameter(s) of adapter 'default' frozen that peft {peft.__version__} made trainable "
        "when adapter 'other' was added with inference_mode=False",
    )


@needs_bug
def test_a_base_parameter_unfrozen_by_hand_stays_trainable():
    def build():
        model = get_peft_model(base_model(), lora_config())
        model.base_model.model.model.norm.weight.requires_grad_(True)
        model.add_adapter("other", lora_config(inference_mode=True))
        return model

    with shim.disabled(NAME):
        upstream = build()
    assert upstream.base_model.model.model.norm.weight.requires_grad is False, "bug: frozen again"

    model = build()
    assert model.base_model.model.model.norm.weight.requires_grad is True
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})
    assert ledger()[1].startswith("kept 9 parameter(s) of adapter 'default' and the base model trainable")


@needs_bug
def test_inject_adapter_in_model_keeps_the_first_adapter_trainable():
    def build():
        model = inject_adapter_in_model(lora_config(), base_model(), adapter_name="default")
        return inject_adapter_in_model(lora_config(inference_mode=True), model, adapter_name="other")

    with shim.disabled(NAME):
        upstream = build()
    assert lora_requires_grad(upstream) == all_frozen(upstream), "bug: every LoRA parameter is frozen"

    model = build()
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})


@needs_bug
def test_saving_with_initial_weight_conversion_keeps_the_trained_adapter_trainable(tmp_path):
    """peft's own ``save_pretrained(path_initial_model_for_weight_conversion=...)`` loads the initial
    adapter frozen beside the trained one, then deletes it: upstream, training stops there."""

    def save(model, name):
        config = model.peft_config["default"]
        config.init_lora_weights = True
        model.save_pretrained(str(tmp_path / name / "initial"))
        config.init_lora_weights = "pissa"
        initial = str(tmp_path / name / "initial")
        model.save_pretrained(str(tmp_path / name / "final"), path_initial_model_for_weight_conversion=initial)

    upstream = get_peft_model(base_model(), lora_config(init_lora_weights="pissa"))
    with shim.disabled(NAME):
        save(upstream, "upstream")
    assert lora_requires_grad(upstream) == all_frozen(upstream), "bug: the trained adapter is frozen"

    model = get_peft_model(base_model(), lora_config(init_lora_weights="pissa"))
    save(model, "patched")
    assert list(model.peft_config) == ["default"]
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})


# -- every combination: peft 0.21's rule, full requires_grad map --------------------------------

COMBINATIONS = [(first, how, second) for first in (True, False) for how in ("load", "add") for second in (True, False)]


def add_second(model, how: str, trainable: bool, path: str, config):
    if how == "load":
        model.load_adapter(path, adapter_name="other", is_trainable=trainable)
    else:
        model.add_adapter("other", config(inference_mode=not trainable))


def flags_by_parameter(model) -> list:
    """``[(name, parameter, requires_grad)]``: parameters are followed by identity (a targeted module's
    weight is renamed ``...base_layer.weight`` when a later adapter wraps it)."""
    return [(name, p, p.requires_grad) for name, p in model.named_parameters()]


def rule_violations(before: list, model, how: str, trainable: bool) -> list[str]:
    """Where ``model`` breaks peft 0.21's rule: old parameters keep their flag; the new adapter's are
    trainable exactly when ``load_adapter(..., is_trainable=True)`` added it."""
    new_adapter_trainable = how == "load" and trainable
    old = {id(p) for _, p, _ in before}
    wrong = [name for name, p, flag in before if p.requires_grad != flag]
    wrong += [
        name for name, p in model.named_parameters() if id(p) not in old and p.requires_grad != new_adapter_trainable
    ]
    return wrong


def upstream_gets_it_right(first: bool, how: str, second: bool, case: str) -> bool:
    """Measured on peft 0.18.0 – 0.20.0: upstream is right only where the flags it forces happen to agree."""
    if not first and not second:
        return True
    return first and second and how == "add" and case != "with_head, other targets"


CASES = {
    "plain": ("plain", "plain", lambda **kw: lora_config(**kw)),
    "other targets": ("plain", "other_targets", lambda **kw: lora_config(target_modules=["k_proj", "o_proj"], **kw)),
    "with_head": ("with_head", "with_head", lambda **kw: lora_config(modules_to_save=["lm_head"], **kw)),
    "with_head, other targets": (
        "with_head",
        "other_targets",
        lambda **kw: lora_config(target_modules=["k_proj", "o_proj"], **kw),
    ),
}


@needs_bug
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "first, how, second",
    COMBINATIONS,
    ids=[f"{'trainable' if f else 'frozen'}-{h}-{'trainable' if s else 'frozen'}" for f, h, s in COMBINATIONS],
)
def test_every_combination_follows_peft_021(saved, case, first, how, second):
    first_path, second_path, config = CASES[case]

    def run():
        model = loaded(saved[first_path], trainable=first)
        before = flags_by_parameter(model)
        add_second(model, how, second, saved[second_path], config)
        return rule_violations(before, model, how, second)

    with shim.disabled(NAME):
        upstream = run()
    # Measured with the patch off: a build between releases inside the gate may carry the fix
    # already (peft 0.20.1.dev0 from huggingface/peft 4ddb88b does). On a release, the table holds.
    right = upstream == []
    if PEFT.base_version == str(PEFT):
        assert right is upstream_gets_it_right(first, how, second, case), upstream
    assert ledger() == (0, "")

    assert run() == []
    assert (ledger()[0] == 0) is right, "an effect is counted exactly where upstream would differ"


# -- what upstream gets right is left alone -----------------------------------------------------


def test_first_injection_freezes_the_base_model_and_counts_nothing():
    with shim.disabled(NAME):
        upstream = get_peft_model(base_model(), lora_config())
    model = get_peft_model(base_model(), lora_config())
    for built in (upstream, model):
        assert lora_requires_grad(built) == expected_requires_grad(built, {"default"})
        assert not any(base_flags(built).values())
    assert ledger() == (0, "")
    assert state() == ("applied" if BUGGY else "skipped")


@needs_use_adapter
def test_trl_style_reference_adapter(saved):
    """What trl's DPO/KTO/GRPO/RLOO trainers do with a PEFT model that already has an adapter:
    ``add_adapter("ref", <the default adapter's config>)``, copy the weights, switch with ``use_adapter``."""
    from trl.trainer.utils import use_adapter

    results = []
    for switched_off in (True, False):
        with shim.disabled(NAME) if switched_off else contextlib.nullcontext():
            model = loaded(saved["plain"], trainable=True)
            model.add_adapter("ref", model.peft_config["default"])
            for name, param in model.named_parameters():
                if ".default." in name:
                    model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
            after_add = lora_requires_grad(model)
            with use_adapter(model, adapter_name="ref"):
                inside = lora_requires_grad(model)
            results.append((after_add, inside, lora_requires_grad(model)))
    assert results[0] == results[1], "the patch changes nothing upstream gets right"
    after_add, inside, after = results[1]
    assert after_add == expected_requires_grad(model, {"default"}) == after
    assert inside == expected_requires_grad(model, {"ref"})
    assert ledger() == (0, "")
    assert state() == ("applied" if BUGGY else "skipped")


@needs_dpo_ref_adapter
def test_trl_dpo_trainer_reference_adapter_trains_default_only(saved, tmp_path):
    """trl's DPOTrainer given a PEFT model with an adapter and no ref_model adds the frozen ``ref`` copy;
    one optimizer step moves the ``default`` adapter and leaves ``ref`` as it was."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from trl import DPOConfig, DPOTrainer

    from tests.tinymodels import SFT_WORDS as words
    from tests.tinymodels import word_tokenizer

    tokenizer = word_tokenizer(words)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(
        tiny_llama_config(vocab_size=len(words), pad_token_id=0, bos_token_id=2, eos_token_id=3)
    )
    model = PeftModel.from_pretrained(base, saved["plain"], is_trainable=True)
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": ["hi how are you", "what is your name"],
            "chosen": [" i am fine", " my cat"],
            "rejected": [" the dog", " a mat"],
        }
    )
    args = DPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        learning_rate=1e-2,
        max_length=16,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=dataset, processing_class=tokenizer)
    assert sorted(model.peft_config) == ["default", "ref"]
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})
    start = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" in name}
    trainer.train()
    moved = {name for name, p in model.named_parameters() if name in start and not torch.equal(p, start[name])}
    assert moved and all(".default." in name for name in moved), moved
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})
    assert ledger() == (0, "")
    assert state() == ("applied" if BUGGY else "skipped")


# -- shape checks, bug probe, the gate ---------------------------------------------------------


@needs_bug
def test_shape_checks_accept_the_installed_peft_and_name_a_changed_signature():
    from peft.peft_model import PeftModel as Model
    from peft.tuners.tuners_utils import BaseTuner

    assert patch_module._check_inject_adapter(BaseTuner.inject_adapter) is None
    assert patch_module._check_load_adapter(Model.load_adapter) is None

    def inject_adapter(self, adapter_name, model):
        pass

    def load_adapter(self, model_id, is_trainable=False, adapter_name="default"):
        pass

    assert "signature changed" in patch_module._check_inject_adapter(inject_adapter)
    assert "signature changed" in patch_module._check_load_adapter(load_adapter)


@needs_bug
def test_the_bug_probe_finds_the_bug_only_with_the_patch_off():
    with shim.disabled(NAME):
        assert bug_found(NAME) is True
    assert bug_found(NAME) is False


@pytest.mark.skipif(BUGGY, reason="version rule: peft 0.21.0 carries the fix (huggingface/peft#3495)")
def test_outside_the_gate_the_patch_is_skipped_and_upstream_is_right(saved):
    assert state() == "skipped"
    record = next(s for s in shim.status() if s.name == NAME)
    assert record.reason == f"peft {peft.__version__} is outside <0.21"
    assert bug_found(NAME) is False

    model = get_peft_model(base_model(), lora_config())
    model.load_adapter(saved["plain"], adapter_name="other", is_trainable=False)
    assert lora_requires_grad(model) == expected_requires_grad(model, {"default"})
    model = loaded(saved["plain"], trainable=False)
    model.load_adapter(saved["plain"], adapter_name="other", is_trainable=True)
    assert lora_requires_grad(model) == expected_requires_grad(model, {"other"})
    assert ledger() == (0, "")
