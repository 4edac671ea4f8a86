"""Load, training steps and trl's disable/enable cycles in one process (report section 3-5): shim on
against ``shim.disabled()``, where the wrappers stay in place but inert, which isolates what runs on
each call; the plain cycle also against ``shim.deactivate()`` (no layers in place, as
``SHIM_DISABLE=all``), where the layers' own cost counts too.

``from_pretrained`` of the saved model is timed call by call; a training step (reentrant and
non-reentrant checkpointing) and trl's two cycles (``unwrap_model_for_generation`` and
``disable_gradient_checkpointing``, on the step's model and on a deep one, since their cost grows
with the modules) are timed in blocks on two identical models, one built with the shim on and one
under ``shim.disabled()``. On and off alternate ABBA; CPU time of the process, wall time beside it.
"""

from __future__ import annotations

from harness import HEADERS, compare, comparison_row, interleave, table, timed
from workloads import (
    batch,
    deactivated,
    generate,
    inert,
    load,
    plain_cycle,
    train_step,
    training_model,
    trl_cycle,
    trl_reference_cycle,
)

GENERATED_TOKENS = 64


def measure(args, directory: str, log) -> dict:
    import accelerate

    import shim

    out = {}
    log("from_pretrained in process")
    load(directory)  # warm caches
    on, off = interleave(
        lambda: timed(lambda: load(directory)), lambda: timed(lambda: inert(lambda: load(directory))), args.rounds
    )
    out["load"] = compare(on, off)

    config, shape = args.sizes["step_config"], args.sizes["batch"]
    input_ids = batch(config, shape)
    for reentrant in (True, False):
        name = "reentrant" if reentrant else "non_reentrant"
        log(f"training step ({name}) in process")
        model_on, opt_on = training_model(config, reentrant)
        with shim.disabled():
            model_off, opt_off = training_model(config, reentrant)
        n = args.steps_per_block
        block_on = lambda: [train_step(model_on, opt_on, input_ids) for _ in range(n)]
        block_off = lambda: inert(lambda: [train_step(model_off, opt_off, input_ids) for _ in range(n)])
        block_on(), block_off()  # warm-up: optimizer state
        on, off = interleave(lambda: timed(block_on, n), lambda: timed(block_off, n), args.rounds * 2)
        out[f"step_{name}"] = compare(on, off)
        del model_on, model_off, opt_on, opt_off

    log(f"generate() of {GENERATED_TOKENS} greedy tokens in process")
    model_on, _ = training_model(config, False)
    with shim.disabled():
        model_off, _ = training_model(config, False)
    for model in (model_on, model_off):
        model.eval()
        model.generation_config.pad_token_id = 0
    prompt = input_ids[:1, :8]
    block_on = lambda: generate(model_on, prompt, GENERATED_TOKENS)
    block_off = lambda: inert(lambda: generate(model_off, prompt, GENERATED_TOKENS))
    block_on(), block_off()
    on, off = interleave(lambda: timed(block_on), lambda: timed(block_off), args.rounds * 2)
    out["generate"] = compare(on, off)
    del model_on, model_off

    log("plain disable/enable cycles (reentrant kwargs) in process")
    reentrant_kwargs = {"use_reentrant": True}
    n = args.cycles_per_block
    model_on, _ = training_model(config, True)
    with shim.disabled():
        model_off, _ = training_model(config, True)
    block_on = lambda: [plain_cycle(model_on, reentrant_kwargs) for _ in range(n)]
    block_off = lambda: inert(lambda: [plain_cycle(model_off, reentrant_kwargs) for _ in range(n)])
    block_on(), block_off()
    on, off = interleave(lambda: timed(block_on, n), lambda: timed(block_off, n), args.rounds * 2)
    out["cycle_plain"] = compare(on, off)
    # The same cycle against no shim layers at all (shim.deactivate(), as SHIM_DISABLE=all): what
    # the inert layers themselves cost is then on the shim's side too.
    block_bare = lambda: [plain_cycle(model_off, reentrant_kwargs) for _ in range(n)]
    on, off = interleave(lambda: timed(block_on, n), lambda: deactivated(lambda: timed(block_bare, n)), args.rounds * 2)
    out["cycle_plain_bare"] = compare(on, off)
    del model_on, model_off

    log("disable/enable cycles in process")
    accelerator = accelerate.Accelerator(cpu=True)
    kwargs = {"use_reentrant": False}
    n = args.cycles_per_block
    deep = dict(config, num_hidden_layers=args.sizes["deep_layers"])
    for suffix, model_config in (("", config), ("_deep", deep)):
        model_on, _ = training_model(model_config, False)
        with shim.disabled():
            model_off, _ = training_model(model_config, False)
        for key, cycle in (
            ("cycle_unwrap", lambda model: trl_cycle(model, accelerator, kwargs)),
            ("cycle_disable_gc", lambda model: trl_reference_cycle(model, kwargs)),
        ):
            block_on = lambda: [cycle(model_on) for _ in range(n)]
            block_off = lambda: inert(lambda: [cycle(model_off) for _ in range(n)])
            block_on(), block_off()
            on, off = interleave(lambda: timed(block_on, n), lambda: timed(block_off, n), args.rounds * 2)
            out[key + suffix] = compare(on, off)
        del model_on, model_off
    return out


def tensors(args) -> str:
    """The saved model's tensors: 9 per decoder layer, and 3."""
    return f"{9 * args.sizes['load_layers'] + 3} tensors"


def report(args, in_process: dict) -> list[str]:
    layers, deep = args.sizes["step_config"]["num_hidden_layers"], args.sizes["deep_layers"]
    labels = {
        "load": (f"from_pretrained ({tensors(args)})", "load"),
        "step_reentrant": ("training step, reentrant", "step"),
        "step_non_reentrant": ("training step, non-reentrant", "step"),
        "generate": (f"generate(), {GENERATED_TOKENS} greedy tokens, {layers} layers", "generate"),
        "cycle_plain": (f"disable/enable(kwargs) cycle, reentrant, {layers} layers", "cycle"),
        "cycle_plain_bare": ("the same cycle, off = shim.deactivate() (no layers)", "cycle"),
        "cycle_unwrap": (f"trl unwrap_model_for_generation cycle, {layers} layers", "cycle"),
        "cycle_disable_gc": (f"trl disable_gradient_checkpointing cycle, {layers} layers", "cycle"),
        "cycle_unwrap_deep": (f"trl unwrap_model_for_generation cycle, {deep} layers", "cycle"),
        "cycle_disable_gc_deep": (f"trl disable_gradient_checkpointing cycle, {deep} layers", "cycle"),
    }
    rows = [comparison_row(label, in_process[key], 1e3, kind, args.quick) for key, (label, kind) in labels.items()]
    return [
        "3-5. Same process, shim on vs shim.disabled() (wrappers in place, inert), identical models; ms",
        table(rows, HEADERS),
    ]
