"""Models saved by a process with the shim, loaded by one without it.

The saving side (``everyday.py``'s ``saved-models-load`` case,
``tests/patches/test_checkpointing_saved_models.py``) builds each object of :data:`OBJECTS` in its
checkpointing state (Llama and ViT: enabled reentrant and not, disabled only, after trl's generation
cycle, a deep copy, a function of the user's own, an optimizer made and its first step not taken: the
first-step audit's hooks on it) and writes it with ``torch.save`` and ``pickle``
(:func:`save`). The loading side is a fresh interpreter (:func:`load_in_fresh_interpreter`, or
``python -m tests.do_no_harm.workflows.saved_models PASSES FOLDER ...``): per pass, ``blocked`` (a
finder first in ``sys.meta_path`` fails every import of ``shim`` and ``shim.*`` with
``ModuleNotFoundError``, as where the shim was never installed) or ``importable``, it loads every file,
trains each model two SGD steps and records the losses (or the error that stopped it), what each
layer holds, and the modules of ``shim`` the process has imported; it prints :data:`MARK` and a JSON
object.

This module imports nothing of the shim, at import or on the loading side, where ``import shim``
fails (a model given ``user_functions.checkpoint_layer`` refers to that module by name, and it
imports none either). The saving side builds the Llama with ``tests/tinymodels.py``, imported there.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import sys

MARK = "saved-models-result: "
FORMATS = ("torch.save", "pickle")


# -- the saving side ------------------------------------------------------------------------------


def tiny_vit():
    """A ViT classifier small enough to build in milliseconds (3 layers of width 16, 8 x 8 images)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=8,
        patch_size=4,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(config).train()


def tiny_llama():
    import torch

    from tests.tinymodels import tiny_llama

    torch.manual_seed(0)
    return tiny_llama(3).train()


MODELS = {"llama": tiny_llama, "vit": tiny_vit}


def enable(model, kwargs):
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable(model):
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()


def generation_cycle(model):
    """What trl does around a generation step: disable, re-enable without arguments (the bare pair
    before trl 0.26)."""
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:
        disable(model)
        model.gradient_checkpointing_enable()
        return
    with disable_gradient_checkpointing(model, None):
        pass


def reentrant(model):
    enable(model, {"use_reentrant": True})


def non_reentrant(model):
    enable(model, {"use_reentrant": False})


def cycled(model):
    enable(model, {"use_reentrant": True})
    generation_cycle(model)


def deep_copied(model):
    enable(model, {"use_reentrant": True})
    return copy.deepcopy(model)


_awaiting: list = []  # optimizers kept alive: the first-step audit's hooks stay on their models until a step


def awaiting_first_step(model):
    """An optimizer made and a training forward and backward run, no step yet: the first-step audit's
    hooks are on the model (its submodules and layers), as in every run between those two."""
    import torch

    enable(model, {"use_reentrant": True})
    _awaiting.append(torch.optim.SGD(model.parameters(), lr=0.1))
    model(**inputs_of(model)).loss.backward()
    model.zero_grad(set_to_none=True)


def own_function(model):
    from tests.do_no_harm.workflows.user_functions import checkpoint_layer

    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_layer)


#: Each state a saved model may be in: a function of the model that puts it there (and returns the
#: object to save, when that is not the model).
STATES = {
    "enabled reentrant": reentrant,
    "enabled non-reentrant": non_reentrant,
    "disabled only": disable,
    "after trl's cycle": cycled,
    "deep copy": deep_copied,
    "own function": own_function,
    "awaiting its first step": awaiting_first_step,
}
OBJECTS = [f"{model}, {state}" for model in MODELS for state in STATES]


def build(name: str):
    """The object ``name`` of :data:`OBJECTS` (``"<model>, <state>"``), in its state, ready to save."""
    import warnings

    model_name, state = name.split(", ", 1)
    model = MODELS[model_name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the gradient_checkpointing_* names from 5.23
        model = STATES[state](model) or model
    return without_input_hooks(model)


def without_input_hooks(model):
    """``model`` without the input-require-grads hooks an enable puts on its embeddings (the ViT gets
    none): local functions, which upstream cannot pickle, so a script that saves a model removes them.
    Every one: upstream's disable removes only the last, and each re-enable adds one more."""
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", None) == "make_inputs_require_grads":
                del module._forward_hooks[key]
    return model


def save(folder: str, names=None, formats=FORMATS, suffix: str = "") -> list:
    """Write each object of ``names`` (every one of :data:`OBJECTS`) in each format to ``folder``, as
    ``<name><suffix>.<format>``; the file names."""
    import torch

    files = []
    for name in names or OBJECTS:
        model = build(name)
        for form in formats:
            path = os.path.join(folder, f"{name}{suffix}.{form}")
            if form == "torch.save":
                torch.save(model, path)
            else:
                with open(path, "wb") as file:
                    pickle.dump(model, file)
            files.append(os.path.basename(path))
    return files


# -- the loading side -----------------------------------------------------------------------------


class NoShim:
    """A meta path finder that fails every import of ``shim`` and ``shim.*`` as an environment
    without the shim does."""

    def find_spec(self, name, path=None, target=None):
        if name == "shim" or name.startswith("shim."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def load(path: str):
    import torch

    if path.endswith(".pickle"):
        with open(path, "rb") as file:
            return pickle.load(file)
    return torch.load(path, weights_only=False)


def inputs_of(model) -> dict:
    import torch

    generator = torch.Generator().manual_seed(1)
    if model.main_input_name == "pixel_values":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=generator), "labels": torch.tensor([0, 1])}
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)
    return {"input_ids": ids, "labels": ids}


def train(model, steps: int = 2) -> list:
    """``steps`` SGD steps: each step's loss."""
    import torch

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = inputs_of(model)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def error_of(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:300]}"


def name_of(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def functions_of(model) -> list:
    """What each module that can checkpoint holds: its flag, the type of its checkpoint function and
    the function under any partials (a plain function is its own)."""
    described = []
    for module in model.modules():
        if "gradient_checkpointing" not in vars(module):
            continue
        function = module.__dict__.get("_gradient_checkpointing_func")
        inner = function
        while isinstance(inner, functools.partial):
            inner = inner.func
        described.append([module.gradient_checkpointing, name_of(type(function)), name_of(inner)])
    return described


def shim_modules() -> list:
    return sorted(name for name in sys.modules if name == "shim" or name.startswith("shim."))


def load_all(folders: list, passes: list) -> dict:
    """Load every file of ``folders`` and train it two steps, once per pass of ``passes``: ``"blocked"``
    (an import of the shim fails: :class:`NoShim`) or ``"importable"``. Per pass: each file's record
    (``{"losses": [...], "functions": ...}`` or ``{"error": ...}``, keyed ``<folder name>/<file>``) and
    the modules of the shim the process holds after it."""
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    result = {"shim modules at start": shim_modules()}
    for how in passes:
        blocker = NoShim()
        if how == "blocked":
            sys.meta_path.insert(0, blocker)
        files = {}
        for folder in folders:
            for file in sorted(os.listdir(folder)):
                key = f"{os.path.basename(folder)}/{file}"
                try:
                    model = load(os.path.join(folder, file))
                    files[key] = {"functions": functions_of(model), "losses": train(model)}
                except Exception as exc:  # the outcome is the record
                    files[key] = {"error": error_of(exc)}
        if blocker in sys.meta_path:
            sys.meta_path.remove(blocker)
        result[how] = {"files": files, "shim modules": shim_modules()}
    return result


def load_in_fresh_interpreter(folders: list, passes: list, timeout: float = 300) -> dict:
    """:func:`load_all` in a fresh interpreter (no ``SHIM_*`` variable), its process group killed
    after ``timeout`` seconds."""
    import signal
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {key: value for key, value in os.environ.items() if not key.startswith("SHIM_")}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "tests.do_no_harm.workflows.saved_models", ",".join(passes), *folders]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root, env=env, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise RuntimeError(f"loading the saved models hung for {timeout} s (killed)") from None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    if process.returncode or not lines:
        raise RuntimeError(f"loading the saved models exited {process.returncode}: {err[-1500:]}")
    return json.loads(lines[-1][len(MARK) :])


if __name__ == "__main__":
    print(MARK + json.dumps(load_all(sys.argv[2:], sys.argv[1].split(","))), flush=True)
