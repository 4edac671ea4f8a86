"""checkpointing-args-aliases: checkpointing set on TrainingArguments' old names after construction
reaches the Trainer's layers, and what the old names hold follows the new ones."""

import dataclasses
import importlib
import inspect
import warnings

import pytest
import transformers
from packaging.version import Version

import shim
from tests.patches.checkpointing_cases import TrainerRows, quietly
from tests.tinymodels import lora_config, tiny_llama

NAME = "checkpointing-args-aliases"
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.23"),
    reason="version rule: activation_checkpointing* exist, with the old names as aliases, from transformers 5.23",
)
SET_LATER = {"use_reentrant": False, "preserve_rng_state": False}


def arguments(directory, cls=transformers.TrainingArguments, **fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # upstream's deprecation of the old names
        return cls(
            output_dir=str(directory), max_steps=1, per_device_train_batch_size=2, report_to=[],
            save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, **fields,
        )  # fmt: skip


def checkpoint_calls(model, args, monkeypatch) -> list[dict]:
    """One ``Trainer.train()`` step: the kwargs of every call that reached torch's checkpoint."""
    import transformers.modeling_utils as modeling_utils

    calls, real = [], modeling_utils.checkpoint

    def recording(function, *positional, **kwargs):
        calls.append(dict(kwargs))
        return real(function, *positional, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", recording)  # what the enable call binds its partial to
    quietly(transformers.Trainer(model=model, args=args, train_dataset=TrainerRows(2)).train)
    return calls


def test_the_old_names_set_after_construction_checkpoint_every_layer_of_a_trainer_step(tmp_path, monkeypatch, ledger):
    def run():
        args = arguments(tmp_path)  # parsed without checkpointing, then set the old way
        args.gradient_checkpointing = True
        args.gradient_checkpointing_kwargs = dict(SET_LATER)
        return checkpoint_calls(tiny_llama(layers=2), args, monkeypatch)

    with shim.disabled(NAME):
        assert run() == [], "bug: upstream's Trainer reads only activation_checkpointing, still False"
    assert run() == [SET_LATER, SET_LATER]  # each layer of the one forward, with the kwargs as set
    effects, last = ledger(NAME)
    assert effects == 2 and "activation_checkpointing_kwargs" in last


def trl_forcing_statements() -> dict[str, tuple[str, str]]:
    """trl's two statements that force reentrant checkpointing for PEFT under ZeRO-3, as each
    trainer module has them (the trainers that have them on the installed trl)."""
    unset = "args.gradient_checkpointing_kwargs = args.gradient_checkpointing_kwargs or {}"
    force = 'args.gradient_checkpointing_kwargs["use_reentrant"] = True'
    found = {}
    for trainer in ("sft", "dpo", "grpo", "rloo", "kto", "reward", "distillation"):
        try:
            module = importlib.import_module(f"trl.trainer.{trainer}_trainer")
        except ImportError:
            continue
        lines = [line.strip() for line in inspect.getsource(module).splitlines()]
        if force in lines:
            at = lines.index(force)
            found[trainer] = (next(line for line in reversed(lines[:at]) if line == unset), force)
    return found


def test_trls_forced_reentrant_reaches_the_layers_of_a_peft_model(tmp_path, monkeypatch):
    """trl's statements run as trl runs them, on its own config: the kwargs unset, so the dict it
    makes is assigned to the old name (the ZeRO-3 branch that holds them needs several ranks)."""
    pytest.importorskip("trl")
    from peft import get_peft_model
    from trl import SFTConfig

    statements = trl_forcing_statements()
    assert "sft" in statements and len(set(statements.values())) == 1, statements  # one pattern in every trainer

    def run():
        args = arguments(tmp_path, SFTConfig, gradient_checkpointing=True)
        for statement in statements["sft"]:
            exec(statement, {"args": args})
        model = get_peft_model(tiny_llama(layers=2), lora_config())
        return checkpoint_calls(model, args, monkeypatch)

    with shim.disabled(NAME):
        assert run() == [{"use_reentrant": False}] * 2, "bug: transformers' own default, not trl's"
    assert run() == [{"use_reentrant": True}] * 2


@pytest.mark.parametrize(
    ("assigned", "value", "partner"),
    [
        ("activation_checkpointing", True, "gradient_checkpointing"),  # trl reads the old name
        ("gradient_checkpointing", False, "activation_checkpointing"),  # trl's kbit path switches it off
        ("activation_checkpointing_kwargs", {"use_reentrant": True}, "gradient_checkpointing_kwargs"),
    ],
)
def test_either_name_assigned_after_construction_is_what_the_other_holds(tmp_path, assigned, value, partner):
    start = not value if isinstance(value, bool) else None

    def run():
        args = arguments(tmp_path, **{assigned: start})
        setattr(args, assigned, value)
        return getattr(args, partner)

    with shim.disabled(NAME):
        assert run() == start, "bug: upstream leaves the other name as it was"
    assert run() == value


def test_parsing_and_copies_end_as_upstream_but_a_replace_that_changed_the_old_name(tmp_path, ledger):
    def outcomes():
        parser = transformers.HfArgumentParser(transformers.TrainingArguments)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parsed = parser.parse_args_into_dataclasses(
                ["--output_dir", str(tmp_path), "--gradient_checkpointing", "--use_cpu", "--report_to", "none",
                 "--gradient_checkpointing_kwargs", '{"use_reentrant": false}'],
            )[0]  # fmt: skip
            base = arguments(tmp_path)
            copies = {
                "replace, old name": dataclasses.replace(base, gradient_checkpointing=True),
                "replace, new name": dataclasses.replace(base, activation_checkpointing=True),
                "replace, old kwargs": dataclasses.replace(
                    arguments(tmp_path, activation_checkpointing_kwargs={"use_reentrant": True}),
                    gradient_checkpointing_kwargs=dict(SET_LATER),
                ),
                "rebuilt, old name": transformers.TrainingArguments(
                    **base.to_dict() | {"gradient_checkpointing": True}
                ),
            }
        seen = {"parsed": (parsed.activation_checkpointing, parsed.activation_checkpointing_kwargs)}
        seen |= {name: (args.activation_checkpointing, args.gradient_checkpointing) for name, args in copies.items()}
        seen["replace, old kwargs"] = copies["replace, old kwargs"].activation_checkpointing_kwargs
        shown = [(w.category.__name__, str(w.message)) for w in caught if "checkpointing" in str(w.message)]
        return seen, shown

    with shim.disabled(NAME):
        upstream, upstream_warnings = outcomes()
    assert (upstream["replace, old name"], upstream["replace, old kwargs"]) == (
        (False, False),
        {"use_reentrant": True},
    ), "bug: lost"
    seen, shown = outcomes()
    assert seen == upstream | {"replace, old name": (True, True), "replace, old kwargs": SET_LATER}
    assert ledger(NAME)[0] == 2
    added = [message for message in shown if message not in upstream_warnings]
    assert [category for category, _ in added] == ["ShimWarning"], added  # the rebuild: which name changed is unknown
    assert "given gradient_checkpointing=True and activation_checkpointing=False" in added[0][1]
    assert "set activation_checkpointing instead" in added[0][1]


def test_trl_configs_default_checkpointing_on_and_the_new_name_switches_it_off_quietly(tmp_path):
    trl = pytest.importorskip("trl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = arguments(tmp_path, trl.SFTConfig, activation_checkpointing=False)
    assert (args.activation_checkpointing, args.gradient_checkpointing) == (False, False)
    assert not [w for w in caught if issubclass(w.category, shim.ShimWarning)]


def test_an_assignment_that_changes_nothing_or_another_field_records_nothing(tmp_path, ledger):
    args = arguments(tmp_path, activation_checkpointing=True)
    args.gradient_checkpointing = True
    args.learning_rate = 1e-3
    assert ledger(NAME)[0] == 0


SETATTR = "transformers.training_args:TrainingArguments.__setattr__"


def test_deactivate_leaves_the_class_as_it_was():
    assert [name for name, _ in shim.wrappers(SETATTR)] == [NAME]  # the shim's layer, on the class itself
    shim.deactivate()
    try:
        assert "__setattr__" not in vars(transformers.TrainingArguments)
        assert transformers.TrainingArguments.__setattr__ is object.__setattr__
    finally:
        shim.activate()
    assert [name for name, _ in shim.wrappers(SETATTR)] == [NAME]
