"""Everyday runs on stock tiny models, uncompiled: ``python tests/workflows/everyday.py CASE ...``.

- ``generate``: greedy ``generate()`` of a Llama and a Qwen2 in eval mode, and of the Llama in
  training mode with reentrant checkpointing on (as between training steps): the tokens.
- ``save-load``: ``save_pretrained``/``from_pretrained`` of a Llama (one with reentrant checkpointing
  on and its embeddings frozen by the user), a Qwen2, and a LoRA adapter (``PeftModel.from_pretrained``,
  trainable): weight digests and every parameter's ``requires_grad``, before and after.
- ``copy-pickle``: ``copy.deepcopy`` and a ``pickle`` round trip of a Llama with checkpointing on,
  reentrant and not (pickled without the input-require-grads hook on its embeddings, a local
  function upstream cannot pickle); one training step on the original and on each copy: losses,
  gradient digests, each layer's checkpointing (flag, function, keywords).
- ``branch``: a layer whose trainable sub-module is used on some calls only (``tinymodels.add_branch``,
  active on the second of three SGD steps) under reentrant checkpointing, against the same steps
  without checkpointing: ``trainable`` (every parameter trains, ``input_ids``), and ``frozen``
  (``inputs_embeds`` from the frozen embeddings, layer 0 and layer 1 frozen but for the branch, so
  layer 1's inputs require no grad and, on steps where the branch is off, nothing in it trains).
- ``trainer-model-init``: ``Trainer(model_init=...)`` builds the model and trains two steps: losses and
  the final weights.
- ``own-checkpoint-function``: checkpointing enabled through ``_set_gradient_checkpointing`` with a
  function of one's own that does not look for its layer (reentrant and not): one training step.
- ``replaced-forward``: a decoder-layer class whose ``forward`` was replaced by a function calling the
  original, then checkpointing enabled (non-reentrant): an eval forward's logits and one training step.
- ``fsdp2-activation-checkpointing``: accelerate's ``fsdp2_apply_ac`` (one process, a stand-in
  accelerator) on a Llama without dropout: one training step.
"""

from __future__ import annotations

import copy
import functools
import pickle
import sys
import tempfile

import torch

import shim  # noqa: F401  (as a training script starts; SHIM_DISABLE=all makes it the run without)
from shim import tinymodels, tinysteps
from tests.workflows import digest, grads, input_ids, quiet, run_cases, weights


def llama(layers: int = 2):
    torch.manual_seed(0)
    return tinymodels.tiny_llama(layers)


def qwen2():
    torch.manual_seed(0)
    return tinymodels.tiny_qwen2(2)


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
    branch = tinymodels.add_branch(model, 1)
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
        sorted(tinysteps.wrong_grads(want["grads"], step["grads"]))
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
            use_cpu=True,
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


CASES = {
    "generate": generate,
    "save-load": save_load,
    "copy-pickle": copy_pickle,
    "branch-trainable": lambda: branch_case(frozen=False),
    "branch-frozen": lambda: branch_case(frozen=True),
    "trainer-model-init": trainer_model_init,
    "own-checkpoint-function": own_checkpoint_function,
    "replaced-forward": replaced_forward,
    "fsdp2-activation-checkpointing": fsdp2_activation_checkpointing,
}

if __name__ == "__main__":
    quiet()
    run_cases(CASES, sys.argv[1:])
