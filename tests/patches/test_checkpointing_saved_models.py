"""A model saved with the shim loads without it, and with it gets its fixes back.

Every object of ``tests/do_no_harm/workflows/saved_models.py`` (a tiny Llama and a tiny ViT, each
enabled reentrant and non-reentrant, disabled only, after trl's generation cycle, deep-copied, and
given a module-level checkpoint function of the user's own) is saved with ``torch.save`` and with
``pickle`` twice by this process: with the shim on, and inside ``shim.disabled()`` (what upstream
saves). A fresh interpreter loads both sets and trains each model two steps:

1. where ``import shim`` fails (a ``sys.meta_path`` finder raises ``ModuleNotFoundError`` for
   ``shim`` and ``shim.*``, as where the shim was never installed): every file saved with the shim
   loads and trains with the losses of the one saved without it, and its layers hold what upstream's
   hold;
2. where the shim is importable but never imported: the same, and no module of the shim is imported
   by the load (it would apply every patch in a process that never opted in); then, with ``import
   shim``, a reentrant Llama loaded from either file gets its fixes back: its layers called with
   ``hidden_states=`` get the gradients of a run without checkpointing, which upstream's loses.

Only public behaviour is read: what a fresh interpreter can load, its ``sys.modules``, losses and
gradients. The everyday subset runs with the shim off and on in
``tests/do_no_harm/workflows/everyday.py`` (``saved-models-load``).
"""

import json

import pytest

import shim
from tests.conftest import run_python
from tests.do_no_harm.workflows import saved_models

REENTRANT = [f"llama, enabled reentrant.{form}" for form in saved_models.FORMATS]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{"on": folder, "off": folder}``: every object saved in every format, with the shim on and
    inside ``shim.disabled()``."""
    folders = {}
    for how in ("off", "on"):
        folders[how] = tmp_path_factory.mktemp("saved") / how
        folders[how].mkdir()
    with shim.disabled():
        saved_models.save(str(folders["off"]))
    saved_models.save(str(folders["on"]))
    return folders


def loaded(saved, passes, then: str = "") -> dict:
    """Both folders loaded in a fresh interpreter (forked after ``import torch``, killed after 240 s),
    once per pass; ``then`` runs after it in the same interpreter (``result`` is what it prints)."""
    folders = [str(saved["off"]), str(saved["on"])]
    code = "import json\nfrom tests.do_no_harm.workflows.saved_models import load_all\n"
    code += f"result = load_all({folders!r}, {passes!r})\n{then}\nprint(json.dumps(result))\n"
    lines = run_python(code, timeout=240, torch_first=True).stdout
    return json.loads(lines.strip().splitlines()[-1])


def summary(record: dict) -> str:
    if "error" in record:
        return record["error"]
    held = sorted({held for _flag, held, _inner in record["functions"]})
    return f"losses {record['losses']}, layers hold {', '.join(held)}"


def as_without_the_shim(files: dict) -> list:
    """Each file saved with the shim whose record (error, losses, what each module holds) differs
    from the same object's saved without it, as a line; the files saved without it must all load."""
    upstream = {key.removeprefix("off/"): record for key, record in files.items() if key.startswith("off/")}
    broken = {name: record["error"] for name, record in upstream.items() if "error" in record}
    assert not broken, f"saved without the shim, these do not load: the test is broken: {broken}"
    assert len(upstream) == len(saved_models.FORMATS) * len(saved_models.OBJECTS)
    return [
        f"{name}: {summary(files['on/' + name])} (saved without the shim: {summary(record)})"
        for name, record in upstream.items()
        if files["on/" + name] != record
    ]


def test_a_model_saved_with_the_shim_loads_where_the_shim_cannot_be_imported(saved):
    """Today 20 of the 24 files saved with the shim fail: ``ModuleNotFoundError: No module named
    'shim'`` (the model's ``_shim_checkpointing_state``); the four with a function of the user's own
    load, but their layers hold a ``functools.partial`` of it where upstream's hold the function."""
    result = loaded(saved, ["blocked"])
    assert result["shim modules at start"] == [] and result["blocked"]["shim modules"] == []
    different = as_without_the_shim(result["blocked"]["files"])
    assert not different, f"{len(different)} files differ:\n" + "\n".join(different)


KEYWORD_GRADS = """
import torch, shim
from tests.steps import keyword_driven_grads, wrong_grads
from tests.do_no_harm.workflows.saved_models import disable, load

def wrong_after_loading(path):
    # the parameters whose gradient differs from the same model's without checkpointing, its
    # decoder layers called with hidden_states= as a keyword
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = load(path)
    disable(reference)
    return sorted(wrong_grads(keyword_driven_grads(reference, ids), keyword_driven_grads(load(path), ids)))

result["keyword-driven"] = {}
for folder in __FOLDERS__:
    for name in __REENTRANT__:
        path = f"{folder}/{name}"
        with shim.disabled():
            upstream = wrong_after_loading(path)
        result["keyword-driven"][path] = {"upstream": len(upstream), "with the shim": wrong_after_loading(path)}
"""


def test_a_model_saved_with_the_shim_loads_without_importing_it_and_gets_its_fixes_back_with_it(saved):
    """Where the shim is installed, today's load imports it (27 modules, every patch applied) and
    the layers given a function of the user's own hold a partial of it. Then, ``import shim``: a
    reentrant Llama loaded from a file saved with or without the shim gets the gradients of no
    checkpointing through keyword-driven layers (upstream, loaded inside ``shim.disabled()``: 28 of 30
    wrong), as ``__setstate__`` hands its function to the checkpointing path again."""
    then = KEYWORD_GRADS.replace("__FOLDERS__", repr([str(saved["off"]), str(saved["on"])]))
    result = loaded(saved, ["importable"], then=then.replace("__REENTRANT__", repr(REENTRANT)))
    for path, grads in result["keyword-driven"].items():
        assert grads["upstream"] > 0, f"{path}: upstream's bug does not show: the test is broken"
        assert grads["with the shim"] == [], f"{path}: loaded with the shim, the fix is lost: {grads}"
    assert result["importable"]["shim modules"] == [], "loading the saved models imported the shim"
    different = as_without_the_shim(result["importable"]["files"])
    assert not different, f"{len(different)} files differ:\n" + "\n".join(different)
