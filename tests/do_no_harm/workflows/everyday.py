"""Everyday runs on stock tiny models, uncompiled: ``python tests/do_no_harm/workflows/everyday.py CASE ...``.

- ``generate``: greedy ``generate()`` of a Llama and a Qwen2 in eval mode, and of the Llama in
  training mode with reentrant checkpointing on (as between training steps): the tokens.
- ``save-load``: ``save_pretrained``/``from_pretrained`` of a Llama (one with reentrant checkpointing
  on and its embeddings frozen by the user), a Qwen2, and a LoRA adapter (``PeftModel.from_pretrained``,
  trainable): weight digests and every parameter's ``requires_grad``, before and after.
- ``copy-pickle``: ``copy.deepcopy`` and a ``pickle`` round trip of a Llama with checkpointing on,
  reentrant and not (pickled without the input-require-grads hook on its embeddings, a local
  function upstream cannot pickle); one training step on the original and on each copy: losses,
  gradient digests, each layer's checkpointing (flag, function, keywords).
- ``branch``: a layer whose trainable sub-module is used on some calls only (``tests.tinymodels.add_branch``,
  active on the second of three SGD steps) under reentrant checkpointing, against the same steps
  without checkpointing: ``trainable`` (every parameter trains, ``input_ids``), and ``frozen``
  (``inputs_embeds`` from the frozen embeddings, layer 0 and layer 1 frozen but for the branch, so
  layer 1's inputs require no grad and, on steps where the branch is off, nothing in it trains).
- ``trainer-model-init``: ``Trainer(model_init=...)`` builds the model and trains two steps: losses and
  the final weights.
- ``own-checkpoint-function``: checkpointing enabled through ``_set_gradient_checkpointing`` with a
  function of one's own that does not look for its layer (reentrant and not): one training step.
- ``checkpoint-function-copies``: functions of one's own that copy the partial they are handed
  (``copy.copy``, of the function under it too, ``copy.deepcopy`` with the layer kept) and checkpoint
  the copy (``tests/do_no_harm/workflows/user_functions.py``): a closure and a partial of a
  module-level function, reentrant and not: one training step each.
- ``replaced-forward``: a decoder-layer class whose ``forward`` was replaced by a function calling the
  original, then checkpointing enabled (non-reentrant): an eval forward's logits and one training step.
- ``training-arguments`` (from 5.23): ``TrainingArguments`` parsed with the old names, the new ones and neither,
  then deep-copied, pickled, copied with ``dataclasses.replace`` of a new name, rebuilt from
  ``to_dict()``: each one's checkpointing fields, and the checkpointing warnings.
- ``fsdp2-activation-checkpointing``: accelerate's ``fsdp2_apply_ac`` (one process, a stand-in
  accelerator) on a Llama without dropout: one training step.
- ``trl-sft-checkpointing``: trl's ``SFTTrainer``, two steps with checkpointing: trl's ``selective`` on a
  plain Llama, and a LoRA config without it: losses, weight digests, the keys of each layer's
  checkpoint partial.
- ``kbit-prepare``: a QLoRA script on a Llama flagged as loaded in 4 bit (``tinymodels.kbit_flagged_llama``):
  peft's ``prepare_model_for_kbit_training`` on a model that does not checkpoint yet, with kwargs of the
  caller's, with ``use_gradient_checkpointing=False``, and on a model that is not quantized, then a LoRA
  adapter and one training step: each layer's checkpointing, the loss, the gradients' digest.
- ``saved-models-load``: a Llama and a ViT enabled reentrant and not, disabled only, after trl's
  generation cycle, deep-copied and given a module-level checkpoint function of the user's own
  (``tests/do_no_harm/workflows/saved_models.py``), saved with ``torch.save`` and ``pickle``, then
  loaded in a fresh interpreter where ``import shim`` fails and again once it is importable: each
  file's two training losses (or its error), what each module holds (flag, the checkpoint
  function's type and the function under its partials), and the modules of the shim that
  interpreter imported (none: a model saved with the shim loads without it and never imports it).

Every case runs on the test device (``SHIM_TEST_DEVICE``: the models, the inputs, and the trainers'
``use_cpu``), but ``saved-models-load``, whose models load in fresh interpreters on the CPU.

The checkpointing path (``tests/test_checkpointing_path.py``); each records only what upstream and a
fixed shim share, and says ``skipped`` where its shape does not exist in the installed transformers:

- ``reentrant-round-trip-cycle`` (from 5.0): a keyword-driven Llama and a frozen-input Llama enabled
  reentrant, pickled or saved with ``torch.save`` and loaded, then trl's disable/enable cycle (the bare
  pair before trl 0.26): each layer's flag and the parameters whose gradient differs from a run
  without checkpointing (upstream's re-enable is non-reentrant, the shim keeps it reentrant: both right).
- ``checkpoint-function-args`` (from 5.23): a function of one's own that finds its layer as
  ``func.args[0]`` and checkpoints only layers with a trainable parameter, reentrant and not, through
  ``_set_gradient_checkpointing`` and assigned after an enable: one training step.
- ``compiled-layer-forward`` (from 5.23): ``LlamaDecoderLayer.forward`` compiled (``eager``),
  checkpointing reentrant and not: how often each layer's attention runs in a step, and the step.
- ``self-checkpointing-forward`` (from 5.23): ``LlamaDecoderLayer.forward`` replaced by a forward that
  checkpoints itself: attention runs, checkpoint-function calls, and the step.
- ``replaced-forward-switched-off`` (from 5.23): a replaced ``forward``, checkpointing enabled once with
  the shim as it is, then a new model while ``replaced-forward-keeps-checkpointing`` is switched off
  (``shim.disable``, ``shim.disabled()``, ``shim.deactivate()``): not checkpointed, the class holding
  the replacement; the step.
- ``staticmethod-forward`` (from 5.23): ``LlamaDecoderLayer.forward`` a ``staticmethod`` (an identity
  layer), checkpointing reentrant and not: one training step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import pickle
import sys
import tempfile

import torch
import transformers
from packaging.version import Version

import shim  # noqa: F401  (as a training script starts; SHIM_DISABLE=all makes it the run without)
from tests import steps as tinysteps
from tests import tinymodels
from tests import tinymodels as testmodels
from tests.do_no_harm.workflows import DEVICE, digest, grads, input_ids, quiet, run_cases, weights

TOLERANCE = DEVICE.tolerance()  # checkpointed against not: tests.devices.GRADIENTS


def llama(layers: int = 2):
    torch.manual_seed(0)
    return DEVICE.put(tinymodels.tiny_llama(layers))


def qwen2():
    torch.manual_seed(0)
    return DEVICE.put(testmodels.tiny_qwen2(2))


def greedy(model) -> list:
    ids = input_ids()
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    return model.generate(ids, **options).tolist()


def generate() -> dict:
    training = llama().train()
    tinysteps.enable_checkpointing(training, {"use_reentrant": True})
    return {
        "llama": greedy(llama().eval()),
        "qwen2": greedy(qwen2().eval()),
        "llama training, reentrant checkpointing": greedy(training),
    }


def frozen(model) -> list:
    return [name for name, p in model.named_parameters() if not p.requires_grad]


def trainable(model) -> int:
    return sum(p.requires_grad for p in model.parameters())


def round_trip(model, load) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = load(folder)
    return {
        "weights": [digest(weights(model)), digest(weights(loaded))],
        "frozen": [frozen(model), frozen(loaded)],
        "trainable": [trainable(model), trainable(loaded)],
    }


def save_load() -> dict:
    from transformers import AutoModelForCausalLM

    frozen = llama()
    tinysteps.enable_checkpointing(frozen, {"use_reentrant": True})
    frozen.model.embed_tokens.requires_grad_(False)
    records = {
        "llama": round_trip(llama(), AutoModelForCausalLM.from_pretrained),
        "llama, checkpointing, frozen embeddings": round_trip(frozen, AutoModelForCausalLM.from_pretrained),
        "qwen2": round_trip(qwen2(), AutoModelForCausalLM.from_pretrained),
    }
    try:
        from peft import PeftModel, get_peft_model
    except ImportError:
        return records
    lora = get_peft_model(llama(), tinymodels.lora_config())
    records["lora adapter"] = round_trip(
        lora, lambda folder: PeftModel.from_pretrained(llama(), folder, is_trainable=True)
    )
    return records


def checkpointing_of(model) -> list:
    """Each layer's flag and what its checkpoint function calls: the function under any partials (a
    subclass of one too), with the arguments and keywords they bind; a plain function binds none."""
    described = []
    for layer in model.model.layers:
        function, args, keywords = getattr(layer, "_gradient_checkpointing_func", None), (), {}
        while isinstance(function, functools.partial):
            args, keywords = function.args + args, {**function.keywords, **keywords}
            function = function.func
        described.append(
            [
                layer.gradient_checkpointing,
                getattr(function, "__qualname__", repr(function)),
                repr(args),
                repr(keywords),
            ]
        )
    return described


def one_step(model) -> dict:
    model.train()
    model.zero_grad(set_to_none=True)
    ids = input_ids()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.item(), "grads": digest(grads(model)), "checkpointing": checkpointing_of(model)}


def without_input_hook(model):
    """``model`` without the input-require-grads hook enabling checkpointing puts on its embeddings
    (from transformers 5.0): a local function, which upstream cannot pickle."""
    if getattr(model, "_require_grads_hooks", None) or hasattr(model, "_require_grads_hook"):
        model.disable_input_require_grads()
    return model


def copy_pickle() -> dict:
    records = {}
    for reentrant in (True, False):
        model = llama()
        tinysteps.enable_checkpointing(model, {"use_reentrant": reentrant})
        twin = copy.deepcopy(model)
        restored = pickle.loads(pickle.dumps(without_input_hook(copy.deepcopy(model))))
        records[f"use_reentrant={reentrant}"] = {
            "original": one_step(model),
            "deepcopy": one_step(twin),
            "pickle": one_step(restored),
        }
    return records


def branch_steps(frozen: bool, checkpointing: bool) -> list:
    """Three SGD steps, the branch active on the second: each step's loss and gradients (or the error
    that stopped the run)."""
    model = llama()
    branch = testmodels.add_branch(model, 1)
    model.train()
    ids = input_ids()
    embeds = None
    if frozen:
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
        model.model.layers[1].requires_grad_(False)
        branch.extra.requires_grad_(True)
        with torch.no_grad():  # before checkpointing puts its input-require-grads hook on the embeddings
            embeds = model.model.embed_tokens(ids)
    if checkpointing:
        tinysteps.enable_checkpointing(model, {"use_reentrant": True})
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    steps = []
    for active in (False, True, False):
        branch.active = active
        optimizer.zero_grad(set_to_none=True)
        try:
            loss = model(input_ids=None if frozen else ids, inputs_embeds=embeds, labels=ids).loss
            loss.backward()
        except Exception as exc:
            steps.append({"branch": active, "error": f"{type(exc).__name__}: {exc}"[:300]})
            break
        trainable = {name: g for name, g in grads(model).items() if name in names}
        steps.append({"branch": active, "loss": loss.item(), "grads": trainable})
        optimizer.step()
    return steps


def branch_case(frozen: bool) -> dict:
    expected = branch_steps(frozen, checkpointing=False)
    got = branch_steps(frozen, checkpointing=True)
    failed = [step["error"] for step in got if "error" in step]
    if failed:
        raise RuntimeError(f"step {len(got)} of 3: {failed[0]}")
    wrong = [
        sorted(tinysteps.wrong_grads(want["grads"], step["grads"], **TOLERANCE))
        + ([] if abs(want["loss"] - step["loss"]) <= 1e-6 else ["loss"])
        for want, step in zip(expected, got)
    ]
    return {
        "steps": [
            {"branch": step["branch"], "loss": step["loss"], "grads": digest(step["grads"]), "wrong": bad}
            for step, bad in zip(got, wrong)
        ],
        "match": not any(wrong),
    }


def trainer_model_init() -> dict:
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder,
            max_steps=2,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=not DEVICE.cuda,
            seed=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model_init=lambda: tinymodels.tiny_llama(2), args=args, train_dataset=data)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "weights": digest(weights(trainer.model))}


def own_checkpoint_function() -> dict:
    from torch.utils.checkpoint import checkpoint

    def mine(function, *args, **kwargs):  # a function of one's own that never looks for its layer
        return checkpoint(function, *args, use_reentrant=reentrant, **kwargs)

    records = {}
    for reentrant in (True, False):
        model = llama(3)
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=mine)
        records[f"use_reentrant={reentrant}"] = one_step(model)
    return records


def checkpoint_function_copies() -> dict:
    """Functions of one's own that copy the partial they are handed (``copy.copy``, of its function
    too, ``copy.deepcopy`` with the layer kept) and checkpoint the copy: a closure and a partial of a
    module-level function, reentrant and not, through ``_set_gradient_checkpointing``."""
    from tests.do_no_harm.workflows import user_functions

    records = {}
    for reentrant in (True, False):
        functions = {
            "closure": user_functions.closure(reentrant),
            "partial": functools.partial(user_functions.checkpoint_a_copy, use_reentrant=reentrant),
        }
        for name, function in functions.items():
            model = llama(3)
            model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)
            records[f"{name}, use_reentrant={reentrant}"] = step_record(model)
    return records


def replaced_forward() -> dict:
    from transformers.models.llama import modeling_llama

    cls = modeling_llama.LlamaDecoderLayer
    saved, original = vars(cls)["forward"], cls.forward
    cls.forward = lambda self, *args, **kwargs: original(self, *args, **kwargs)
    try:
        model = llama(3)
        tinysteps.enable_checkpointing(model, {"use_reentrant": False})
        with torch.no_grad():
            logits = model.eval()(input_ids()).logits
        record = one_step(model)
    finally:
        cls.forward = saved
    return {
        "eval logits": digest({"logits": logits}),
        "step": {k: v for k, v in record.items() if k != "checkpointing"},
    }


def fsdp2_activation_checkpointing() -> dict:
    from accelerate.utils import fsdp_utils

    model = llama(2)
    model.config.use_cache = False  # as a training script sets it (transformers 4.x builds a cache when training)
    model = fsdp_utils.fsdp2_apply_ac(tinysteps.fsdp2_accelerator(model), model)
    record = one_step(model)
    return {"loss": record["loss"], "grads": record["grads"]}


# -- the checkpointing path -------------------------------------------------------------------------

TRANSFORMERS = Version(transformers.__version__)
REPLACED_FORWARD = "replaced-forward-keeps-checkpointing"


def kbit_prepare() -> dict:
    import peft

    def qlora(configured, quantized=True, **prepare_kwargs) -> dict:
        model = DEVICE.put(tinymodels.kbit_flagged_llama(2))
        model.is_loaded_in_4bit = quantized
        if configured is not None:
            tinysteps.enable_checkpointing(model, configured)
        peft.prepare_model_for_kbit_training(model, **prepare_kwargs)
        torch.manual_seed(1)
        lora = peft.get_peft_model(model, tinymodels.lora_config(init_lora_weights=False)).train()
        ids = input_ids()
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        return {"checkpointing": checkpointing_of(model), "loss": loss.item(), "grads": digest(grads(lora))}

    return {
        "fresh model": qlora(None),
        "fresh model, caller's kwargs": qlora(None, gradient_checkpointing_kwargs={"use_reentrant": False}),
        "configured, caller's kwargs": qlora(
            {"use_reentrant": False, "preserve_rng_state": False}, gradient_checkpointing_kwargs={"use_reentrant": True}
        ),
        "configured, use_gradient_checkpointing=False": qlora(
            {"use_reentrant": False, "preserve_rng_state": False}, use_gradient_checkpointing=False
        ),
        "configured, not quantized": qlora({"use_reentrant": False, "preserve_rng_state": False}, quantized=False),
    }


def skipped_before(version: str):
    """A record saying the case's shape does not exist before transformers ``version``, or None."""
    if TRANSFORMERS < Version(version):
        return {"skipped": f"transformers {transformers.__version__} < {version}"}
    return None


def keyword_driven():
    """A Llama whose layers are called with ``hidden_states=``: the model and its gradients' function."""
    model = llama(3).train()
    ids = input_ids()
    return model, lambda m: tinysteps.keyword_driven_grads(m, ids)


def frozen_input():
    model, loss_of = tinymodels.frozen_input_llama(device=DEVICE.type)
    return model, lambda m: tinysteps.trainable_grads(m, loss_of)


def pickled(model):
    return pickle.loads(pickle.dumps(without_input_hook(model)))


def torch_saved(model):
    buffer = io.BytesIO()
    torch.save(without_input_hook(model), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def generation_cycle(model) -> str:
    """What trl does around a generation step: disable, re-enable without arguments."""
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable()
        return "bare disable/enable"
    with disable_gradient_checkpointing(model, None):
        pass
    return "trl disable_gradient_checkpointing"


def reentrant_round_trip_cycle() -> dict:
    skipped = skipped_before("5.0")  # 4.x re-enables reentrant: upstream loses the gradients the shim keeps
    if skipped:
        return skipped
    records = {}
    for trip, load in (("pickle", pickled), ("torch.save", torch_saved)):
        for name, build in (("keyword-driven", keyword_driven), ("frozen-input", frozen_input)):
            model, grads_of = build()
            reference = grads_of(model)
            tinysteps.enable_checkpointing(model, {"use_reentrant": True})
            model = load(model)
            cycle = generation_cycle(model)
            records[f"{trip}, {name}"] = {
                "cycle": cycle,
                "flags": [layer.gradient_checkpointing for layer in model.model.layers],
                "wrong": sorted(tinysteps.wrong_grads(reference, grads_of(model), **TOLERANCE)),
            }
    return records


def frozen_first_layer_llama(layers: int = 3):
    model = llama(layers).train()
    model.model.layers[0].requires_grad_(False)
    return model


def step_record(model) -> dict:
    """One training step: its loss, the gradients' digest."""
    record = one_step(model)
    return {"loss": record["loss"], "grads": record["grads"]}


def checkpoint_function_args() -> dict:
    skipped = skipped_before("5.23")  # the layer hands over partial(forward, layer) from 5.23
    if skipped:
        return skipped
    from torch.utils.checkpoint import checkpoint

    def finds_layer_in_args(reentrant):
        def checkpoint_trainable_layers(func, *args, **kwargs):
            layer = func.args[0]
            if any(p.requires_grad for p in layer.parameters()):
                return checkpoint(func, *args, use_reentrant=reentrant, **kwargs)
            return func(*args, **kwargs)

        return checkpoint_trainable_layers

    records = {}
    for reentrant in (True, False):
        model = frozen_first_layer_llama()
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=finds_layer_in_args(reentrant))
        records[f"_set_gradient_checkpointing, use_reentrant={reentrant}"] = step_record(model)
        model = frozen_first_layer_llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = finds_layer_in_args(reentrant)
        records[f"enable, then assign, use_reentrant={reentrant}"] = step_record(model)
    return records


def counted_step(model, count_calls: bool = True) -> dict:
    """One training step, with how many times each layer's attention ran and (``count_calls``) how many
    times a layer's checkpoint function was called (counted through the layers' ``__dict__``)."""
    attention = [0] * len(model.model.layers)

    def hook(index):
        return lambda *_: attention.__setitem__(index, attention[index] + 1)

    handles = [layer.self_attn.register_forward_hook(hook(index)) for index, layer in enumerate(model.model.layers)]
    calls, held = [], {}

    def counting(function):
        def call(*args, **kwargs):
            calls.append(1)
            return function(*args, **kwargs)

        return call

    for layer in model.model.layers if count_calls else ():
        function = layer.__dict__.get("_gradient_checkpointing_func")
        if function is not None:
            held[layer] = function
            layer.__dict__["_gradient_checkpointing_func"] = counting(function)
    try:
        record = step_record(model)
    finally:
        for handle in handles:
            handle.remove()
        for layer, function in held.items():
            layer.__dict__["_gradient_checkpointing_func"] = function
    record["attention runs"] = attention
    if count_calls:
        record["checkpoint calls"] = len(calls)
    return record


@contextlib.contextmanager
def layer_forward(forward):
    """``LlamaDecoderLayer.forward`` set to ``forward`` (a function of the original) inside the block,
    put back after it."""
    from transformers.models.llama import modeling_llama

    cls = modeling_llama.LlamaDecoderLayer
    saved = vars(cls)["forward"]
    cls.forward = forward(cls.forward)
    try:
        yield cls
    finally:
        cls.forward = saved


def compiled_layer_forward() -> dict:
    skipped = skipped_before("5.23")  # transformers checkpoints inside the class's forward from 5.23
    if skipped:
        return skipped
    records = {}
    for reentrant in (True, False):
        with layer_forward(lambda original: torch.compile(original, backend="eager")):
            model = llama(2).train()
            tinysteps.enable_checkpointing(model, {"use_reentrant": reentrant})
            records[f"use_reentrant={reentrant}"] = counted_step(model, count_calls=False)
        torch._dynamo.reset()
    return records


def self_checkpointing_forward() -> dict:
    skipped = skipped_before("5.23")
    if skipped:
        return skipped

    def checkpointing_itself(original):
        def forward(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(functools.partial(original, self, **kwargs), *args)
            return original(self, *args, **kwargs)

        return forward

    records = {}
    for reentrant in (True, False):
        with layer_forward(checkpointing_itself):
            model = frozen_first_layer_llama(2)
            tinysteps.enable_checkpointing(model, {"use_reentrant": reentrant})
            records[f"use_reentrant={reentrant}"] = counted_step(model)
    return records


@contextlib.contextmanager
def switched_off(how: str):
    """``replaced-forward-keeps-checkpointing`` off inside the block, ``how`` says by what; as it was after."""
    if how == "shim.disable(name)":
        was_on = any(p.name == REPLACED_FORWARD and p.state == "applied" for p in shim.status())
        shim.disable(REPLACED_FORWARD)
        try:
            yield
        finally:
            if was_on:
                shim.enable(REPLACED_FORWARD)
    elif how == "shim.deactivate()":
        shim.deactivate()
        try:
            yield
        finally:
            shim.activate()
    else:
        with shim.disabled():
            yield


def replaced_forward_switched_off() -> dict:
    skipped = skipped_before("5.23")
    if skipped:
        return skipped

    def replaced(original):
        return lambda self, *args, **kwargs: original(self, *args, **kwargs)

    def checkpointed_step():
        model = llama(3).train()
        tinysteps.enable_checkpointing(model, {"use_reentrant": False})
        return counted_step(model)

    records = {}
    with layer_forward(replaced) as cls:
        replacement = vars(cls)["forward"]
        checkpointed_step()  # the shim as it is (its outcome differs from upstream's: not recorded)
        for how in ("shim.disable(name)", "shim.disabled()", "shim.deactivate()"):
            with switched_off(how):
                record = checkpointed_step()
                record["the class holds the replacement"] = vars(cls)["forward"] is replacement
            records[how] = record
            checkpointed_step()  # switched back on (not recorded)
    return records


def staticmethod_forward() -> dict:
    skipped = skipped_before("5.23")
    if skipped:
        return skipped
    records = {}
    for reentrant in (True, False):
        with layer_forward(lambda original: staticmethod(lambda hidden_states, *args, **kwargs: hidden_states)):
            model = llama(2).train()
            tinysteps.enable_checkpointing(model, {"use_reentrant": reentrant})
            records[f"use_reentrant={reentrant}"] = step_record(model)
    return records


def training_arguments() -> dict:
    """TrainingArguments as scripts build and copy them: parsed from the command line (old names, new
    names, JSON kwargs), copied, pickled, rebuilt unchanged, one new name set later: what each ends
    with, and the checkpointing warnings upstream gives."""
    import dataclasses
    import warnings

    skipped = skipped_before("5.23")  # the new names, with the old ones as aliases, exist from 5.23
    if skipped:
        return skipped

    fields = ("activation_checkpointing", "activation_checkpointing_kwargs", "gradient_checkpointing")
    fields += ("gradient_checkpointing_kwargs", "learning_rate")
    lines = {
        "old names": ["--gradient_checkpointing", "--gradient_checkpointing_kwargs", '{"use_reentrant": true}'],
        "new names": ["--activation_checkpointing", "--activation_checkpointing_kwargs", '{"use_reentrant": false}'],
        "neither": ["--learning_rate", "0.001"],
    }
    records = {}
    with tempfile.TemporaryDirectory() as directory:
        parser = transformers.HfArgumentParser(transformers.TrainingArguments)
        for name, line in lines.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                args = parser.parse_args_into_dataclasses(
                    ["--output_dir", directory, "--use_cpu", "--report_to", "none", *line]
                )[0]
                copies = {
                    "parsed": args,
                    "deepcopy": copy.deepcopy(args),
                    "pickle": pickle.loads(pickle.dumps(args)),
                    "replace, new name": dataclasses.replace(args, activation_checkpointing=True),
                    "rebuilt": transformers.TrainingArguments(**args.to_dict()),
                }
                copies["deepcopy"].learning_rate = 0.5
            records[name] = {
                copied: {field: repr(getattr(value, field, None)) for field in fields}
                for copied, value in copies.items()
            }
            records[name]["warnings"] = sorted({str(w.message) for w in caught if "checkpointing" in str(w.message)})
    return records


def trl_sft_checkpointing() -> dict:
    """trl's ``SFTTrainer`` as users run it where ``trl-selective-reaches-peft`` sits: ``selective``
    checkpointing on a plain model (trl's wrapper reached directly), and a LoRA model without it."""
    import importlib.util

    if not all(importlib.util.find_spec(name) for name in ("trl", "peft", "datasets")):
        return {"outcome": "skipped", "why": "trl, peft or datasets is not installed"}
    import trl
    from trl import SFTConfig, SFTTrainer

    records = {}
    for case, selective, lora in (("selective", True, False), ("lora", False, True)):
        if selective and not hasattr(trl.models, "enable_selective_activation_checkpointing"):
            records[case] = {"outcome": "skipped", "why": "trl has no selective checkpointing"}
            continue
        tokenizer, model, dataset = testmodels.sft_inputs(2)
        with tempfile.TemporaryDirectory() as folder:
            args = SFTConfig(
                output_dir=folder,
                per_device_train_batch_size=2,
                max_steps=2,
                max_length=16,
                learning_rate=1e-2,
                logging_steps=1,
                use_cpu=not DEVICE.cuda,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                seed=0,
                gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"selective": True} if selective else {"use_reentrant": False},
            )
            trainer = SFTTrainer(
                model=model,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=tinymodels.lora_config(init_lora_weights=False) if lora else None,
            )
            trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        layers = trainer.model.get_base_model().model.layers if lora else trainer.model.model.layers
        context = [sorted(getattr(layer._gradient_checkpointing_func, "keywords", {})) for layer in layers]
        records[case] = {"losses": losses, "weights": digest(weights(trainer.model)), "keywords": context}
    return records


def saved_models_load() -> dict:
    """Every object of ``saved_models.OBJECTS`` saved with ``torch.save`` and ``pickle`` by this process,
    then loaded and trained two steps in a fresh interpreter where ``import shim`` fails, and again
    there once it is importable: each file's losses and what its layers hold, and the modules of the
    shim that interpreter imported."""
    from tests.do_no_harm.workflows import saved_models

    with tempfile.TemporaryDirectory() as directory:
        folder = os.path.join(directory, "saved")  # the same name in both runs: it keys the records
        os.mkdir(folder)
        saved_models.save(folder)
        return saved_models.load_in_fresh_interpreter([folder], ["blocked", "importable"])


CASES = {
    "generate": generate,
    "save-load": save_load,
    "copy-pickle": copy_pickle,
    "branch-trainable": lambda: branch_case(frozen=False),
    "branch-frozen": lambda: branch_case(frozen=True),
    "trainer-model-init": trainer_model_init,
    "own-checkpoint-function": own_checkpoint_function,
    "checkpoint-function-copies": checkpoint_function_copies,
    "replaced-forward": replaced_forward,
    "fsdp2-activation-checkpointing": fsdp2_activation_checkpointing,
    "kbit-prepare": kbit_prepare,
    "reentrant-round-trip-cycle": reentrant_round_trip_cycle,
    "checkpoint-function-args": checkpoint_function_args,
    "compiled-layer-forward": compiled_layer_forward,
    "self-checkpointing-forward": self_checkpointing_forward,
    "staticmethod-forward": staticmethod_forward,
    "replaced-forward-switched-off": replaced_forward_switched_off,
    "training-arguments": training_arguments,
    "trl-sft-checkpointing": trl_sft_checkpointing,
    "saved-models-load": saved_models_load,
}

if __name__ == "__main__":
    quiet()
    run_cases(CASES, sys.argv[1:])
