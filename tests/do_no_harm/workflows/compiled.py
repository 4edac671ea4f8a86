"""``torch.compile`` on stock tiny decoders, and the two reentrant fixes compiled.

Cases, ``python tests/do_no_harm/workflows/compiled.py CASE ...``:

- ``<model>/eval/<backend>``: ``torch.compile(model)``, an eval forward under ``no_grad``; its logits
  against the uncompiled model's;
- ``<model>/generate/<backend>``: ``model.forward = torch.compile(model.forward)``, greedy
  ``generate()``; its tokens against the uncompiled ``generate()``'s;
- ``<model>/train-<none|reentrant|non-reentrant>/<backend>``: two SGD steps of ``torch.compile(model)``
  with that checkpointing; losses and gradients against two uncompiled steps without checkpointing;
- ``fix-keyword/<backend>``: ``tests.steps.keyword_driven_grads`` (decoder layers called with
  ``hidden_states=``), reentrant checkpointing, every decoder layer compiled in place
  (``layer.compile()``); gradients against the uncompiled run without checkpointing;
- ``fix-frozen-input/<backend>``: ``tests.tinymodels.frozen_input_llama``, reentrant checkpointing,
  ``torch.compile(model)``; gradients against the uncompiled run without checkpointing.
- ``graph-break/<function>/<backend>/<regional|whole>``: a graph break in every decoder layer
  (``user_functions.graph_break_in_every_layer``: ``LlamaMLP.forward`` calls
  ``torch._dynamo.graph_break()``), checkpointing with a function of the user's own set with
  ``_set_gradient_checkpointing`` (``closure``, a ``partial`` of a module-level function, ``args0``:
  one that finds its layer as ``func.args[0]``, from transformers 5.23), each non-reentrant, the
  first two checkpointing a copy of the partial they are handed (``copy.copy``, ``copy.deepcopy``;
  compiled, dynamo runs a layer that copies it uncompiled, upstream too); every decoder
  layer compiled in place (``regional``) or ``torch.compile(model)`` (``whole``): two SGD steps,
  losses and gradients against two uncompiled steps without checkpointing.

``<model>`` is ``llama`` or ``qwen2``, ``<backend>`` one of torch's (``eager``, ``aot_eager``,
``inductor``); a case ending in ``/bf16`` runs its forwards under bf16 autocast (each forward and its
loss, as a training script does: the optimizer step outside it, where autocast's cache of cast weights
would go stale), its references too (on CUDA). Every case runs on the
test device (``SHIM_TEST_DEVICE``). "Against" means within ``COMPILED_GRADIENTS`` for the device
(``match``, with the names that do not in ``wrong``); tokens must be equal. Every record also counts the graphs dynamo compiled and the graph
breaks it took (``graphs``, ``breaks``, and the distinct reasons, ``reasons``): a layer the shim made
untraceable runs, uncompiled, with correct results, and only these show it.

Where the checkpoint call is inside the compiled code, upstream's reentrant checkpointing has
neither bug the two reentrant patches fix (dynamo turns ``torch.utils.checkpoint`` into its own
operator) and the ``fix-*`` cases match without the shim too; a layer compiled on its own before
transformers 5.23 checkpoints in its ``__call__``, outside the compiled code, and shows the bug.
"""

from __future__ import annotations

import sys

import torch
import transformers
from packaging.version import Version

import shim  # noqa: F401  (as a training script starts; SHIM_DISABLE=all makes it the run without)
from tests import devices, tinymodels
from tests import steps as tinysteps
from tests import tinymodels as testmodels
from tests.do_no_harm.workflows import DEVICE, digest, grads, input_ids, quiet, run_cases, user_functions, weights

TRANSFORMERS = Version(transformers.__version__)

#: Compiled against eager. On a CPU ``tests.steps.wrong_grads``' defaults (measured: 0 on
#: eager/aot_eager, 3e-8 inductor); on CUDA inductor's Triton kernels sum in their own order, and under
#: bf16 autocast it keeps in float32 what eager rounds to bf16 (stated, not yet measured on a device).
COMPILED_GRADIENTS = devices.Tolerances(cpu=(1e-5, 1e-6), cuda=(1e-4, 1e-5), bf16=(5e-2, 1e-2))
MODELS = {"llama": lambda: tinymodels.tiny_llama(2), "qwen2": lambda: testmodels.tiny_qwen2(2)}
BF16 = "/bf16"  # a case name's ending: the case runs under bf16 autocast


class Running:
    """Where the case being run computes: the test device, its bf16 variant for a ``/bf16`` case."""

    device = DEVICE


def autocast():
    return Running.device.autocast()


def tolerance() -> dict:
    return Running.device.tolerance(COMPILED_GRADIENTS)


def build(model: str):
    torch.manual_seed(0)
    return DEVICE.put(MODELS[model]())


def close(got, expected) -> bool:
    return torch.allclose(got, expected, **tolerance())


def evaluate(model: str, backend: str) -> dict:
    net = build(model).eval()
    ids = input_ids()
    with torch.no_grad(), autocast():
        expected = net(ids).logits
        got = torch.compile(net, backend=backend)(ids).logits
    return {"logits": digest({"logits": got}), "match": close(got, expected)}


def generate(model: str, backend: str) -> dict:
    net = build(model).eval()
    ids = input_ids()
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    with autocast():
        expected = net.generate(ids, **options)
    net.forward = torch.compile(net.forward, backend=backend)
    with autocast():
        got = net.generate(ids, **options)
    return {"tokens": got.tolist(), "match": torch.equal(got, expected)}


def steps(model, forward, count: int = 2) -> tuple[list, list]:
    """``count`` SGD steps of ``forward`` (the model or its compiled form): losses and gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = input_ids()
    losses, gradients = [], []
    for _ in range(count):
        optimizer.zero_grad(set_to_none=True)
        with autocast():  # the forward and its loss; backward and the step outside, as autocast asks
            loss = forward(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        gradients.append(grads(model))
        optimizer.step()
    return losses, gradients


def compared(net, losses, gradients, expected_losses, expected_grads) -> dict:
    """Losses, gradients and weights after the steps, and whether they match the reference steps'."""
    wrong = sorted(
        {
            name
            for got, expected in zip(gradients, expected_grads)
            for name in tinysteps.wrong_grads(expected, got, **tolerance())
        }
    )
    match = not wrong and all(close(got, expected) for got, expected in zip(losses, expected_losses))
    return {
        "losses": [loss.item() for loss in losses],
        "grads": digest(gradients),
        "weights": digest(weights(net)),
        "match": match,
        "wrong": wrong,
    }


def train(model: str, checkpointing: str, backend: str) -> dict:
    reference = build(model).train()
    expected_losses, expected_grads = steps(reference, reference)
    net = build(model).train()
    if checkpointing != "none":
        tinysteps.enable_checkpointing(net, {"use_reentrant": checkpointing == "reentrant"})
    losses, gradients = steps(net, torch.compile(net, backend=backend))
    return compared(net, losses, gradients, expected_losses, expected_grads)


def graph_break(function: str, backend: str, how: str) -> dict:
    """A graph break in every decoder layer, checkpointing with a function of the user's own
    (``user_functions.NON_REENTRANT[function]``, set with ``_set_gradient_checkpointing``); every
    decoder layer compiled in place (``regional``) or the whole model
    (``whole``): two SGD steps against two uncompiled steps without checkpointing."""
    if function == "args0" and TRANSFORMERS < Version("5.23"):
        return {"skipped": f"transformers {transformers.__version__}: the layer is func.args[0] from 5.23"}
    with user_functions.graph_break_in_every_layer():
        reference = build("llama").train()
        expected_losses, expected_grads = steps(reference, reference)
        net = build("llama").train()
        net._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=user_functions.NON_REENTRANT[function])
        if how == "regional":
            for layer in net.model.layers:
                layer.compile(backend=backend)
            forward = net
        else:
            forward = torch.compile(net, backend=backend)
        losses, gradients = steps(net, forward)
    return compared(net, losses, gradients, expected_losses, expected_grads)


def fix_keyword(backend: str) -> dict:
    net = build("llama").train()
    ids = input_ids()
    with autocast():  # one backward each, no step between: the whole of it under autocast
        expected = tinysteps.keyword_driven_grads(net, ids)
    tinysteps.enable_checkpointing(net, {"use_reentrant": True})
    for layer in net.model.layers:
        layer.compile(backend=backend)
    with autocast():
        got = tinysteps.keyword_driven_grads(net, ids)
    wrong = tinysteps.wrong_grads(expected, got, **tolerance())
    return {"grads": digest(got), "match": not wrong, "wrong": wrong}


def fix_frozen_input(backend: str) -> dict:
    net, loss_of = tinymodels.frozen_input_llama(3, device=DEVICE.type)
    with autocast():
        expected = tinysteps.trainable_grads(net, loss_of)
    tinysteps.enable_checkpointing(net, {"use_reentrant": True})
    compiled = torch.compile(net, backend=backend)
    with autocast():
        got = tinysteps.trainable_grads(net, lambda _: loss_of(compiled))
    wrong = tinysteps.wrong_grads(expected, got, **tolerance())
    return {"grads": digest(got), "match": not wrong, "wrong": wrong}


def counted(run):
    """``run`` with dynamo's count of compiled graphs and graph breaks added to its record."""

    def case() -> dict:
        from torch._dynamo.utils import counters

        counters.clear()
        record = run()
        breaks = counters["graph_break"]
        return {
            **record,
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(breaks.values()),
            "reasons": sorted(breaks),
        }

    return case


def case(name: str):
    """The case ``name``: counted, and under bf16 autocast on the test device where it ends in ``/bf16``."""
    if not name.endswith(BF16):
        return counted(plan(name))
    run = counted(plan(name.removesuffix(BF16)))

    def in_bf16() -> dict:
        Running.device = devices.Device(DEVICE.type, bf16=True)
        try:
            return run()
        finally:
            Running.device = DEVICE

    return in_bf16


def plan(name: str):
    parts = name.split("/")
    if parts[0] == "fix-keyword":
        return lambda: fix_keyword(parts[1])
    if parts[0] == "fix-frozen-input":
        return lambda: fix_frozen_input(parts[1])
    if parts[0] == "graph-break":
        return lambda: graph_break(parts[1], parts[2], parts[3])
    model, kind, backend = parts
    if kind == "eval":
        return lambda: evaluate(model, backend)
    if kind == "generate":
        return lambda: generate(model, backend)
    return lambda: train(model, kind.removeprefix("train-"), backend)


if __name__ == "__main__":
    quiet()
    run_cases({name: case(name) for name in sys.argv[1:]}, sys.argv[1:])
