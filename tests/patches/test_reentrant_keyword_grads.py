"""reentrant-keyword-grads on the installed transformers: reentrant checkpointing must keep the gradients of tensors a
layer receives by keyword.

Every test first shows the bug with the patch switched off (or, for paths the patch must not
touch, that the patch changes nothing), then the fix with it on.
"""

import collections
import functools
import warnings

import pytest
import torch
import transformers
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from packaging.version import Version
from torch.utils.checkpoint import checkpoint

import shim
from shim import runtime
from shim.checkpointing import LayerCheckpoint, check, is_reentrant, wants_grad
from shim.patches._checkpointing_state import same_function
from shim.tools.targets import quiet_transformers
from tests.conftest import run_python
from tests.patches.checkpointing_cases import quietly
from tests.patches.checkpointing_cases import tiny_llama as stock_tiny_llama
from tests.steps import enable_checkpointing, keyword_driven_grads, wrong_grads
from tests.tinymodels import tiny_llama_config

NAME = "reentrant-keyword-grads"
# Upstream, on this target: the patch and the one stacked with it (which acts when no input
# requires grad, so on the layers after one whose keyword gradients upstream lost).
UPSTREAM = (NAME, "reentrant-frozen-input-grads")
VERSION = Version(transformers.__version__)
GradientCheckpointingLayer = transformers.modeling_layers.GradientCheckpointingLayer
quiet_transformers()


@pytest.fixture(autouse=True)
def _applied_and_quiet():
    # every test here is about the applied patch: those that check it leaves a path unchanged
    # would pass vacuously without it
    assert shim.registry.is_on(NAME), shim.status()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_* names from 5.23
        # torch: "None of the inputs have requires_grad=True" (the bug itself) and "use_reentrant
        # should be passed explicitly" (the cases that rely on torch's default)
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture
def diversions():
    """How many layer calls the patch diverted (lifted keyword tensors) since the test began: the
    effects it counted, one per call it changed."""
    before = runtime.count(NAME)
    return lambda: runtime.count(NAME) - before


def enable_on(layer, function):
    """Enable checkpointing with ``function`` through transformers' own ``_set_gradient_checkpointing``
    (the enable path), on a bare layer as on a model."""
    transformers.PreTrainedModel._set_gradient_checkpointing(layer, enable=True, gradient_checkpointing_func=function)


def tiny_llama(layers=3, **overrides):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers, **overrides))
    model.train()
    return model


def input_ids(model, batch=2, length=8):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)


def test_patch_is_applied():
    assert shim.registry.is_on(NAME)
    assert check(transformers.modeling_layers.GradientCheckpointingLayer) is None


# -- the measured case -------------------------------------------------------------------------


@pytest.mark.autocast
def test_keyword_hidden_states_get_their_gradients(device):
    model = device.put(tiny_llama(layers=3))
    ids = device.put(input_ids(model))
    with device.autocast():
        reference = keyword_driven_grads(model, ids)
        assert len(reference) == 30 and all(grad is not None for grad in reference.values())

        enable_checkpointing(model, {"use_reentrant": True})
        with shim.disabled(*UPSTREAM):
            upstream = keyword_driven_grads(model, ids)
        patched = keyword_driven_grads(model, ids)

    wrong = wrong_grads(reference, upstream, **device.tolerance())
    assert len(wrong) == 28, "bug: upstream loses every gradient before the last layer's output"
    assert sum(grad is None for grad in upstream.values()) == 28
    assert wrong_grads(reference, patched, **device.tolerance()) == []
    assert all(grad is not None for grad in patched.values())


def _offload_on_cpu(monkeypatch):
    # transformers' offload closure (5.17+) asks save_on_cpu for pinned memory, which torch refuses
    # on a machine without an accelerator, with or without the shim: pin nothing, keep the closure.
    original = transformers.modeling_utils.save_on_cpu
    monkeypatch.setattr(
        transformers.modeling_utils, "save_on_cpu", lambda pin_memory=False, **kw: original(pin_memory=False, **kw)
    )
    return {"offload": True}


def _enabled_by_other_code(function):
    """Checkpointing enabled with a function of one's own through ``_set_gradient_checkpointing``,
    as training frameworks that bring their own checkpoint function do."""

    def enable(model):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)

    return enable


def _closure(function, *args):
    return checkpoint(function, *args, use_reentrant=True)


# (id, how checkpointing is switched on, reentrant?)
ENABLERS = [
    ("api-reentrant", {"use_reentrant": True}, True),
    ("api-non-reentrant", {"use_reentrant": False}, False),
    # transformers' default when no kwargs are given: reentrant in 4.x, non-reentrant from 5.0
    ("api-default", None, VERSION < Version("5.0")),
    # kwargs without use_reentrant: torch's own default, reentrant
    ("api-torch-default", {"preserve_rng_state": True}, True),
    ("api-offload-reentrant", ({"use_reentrant": True}, "offload"), True),
    ("own-partial", _enabled_by_other_code(functools.partial(checkpoint, use_reentrant=True)), True),
    (
        "own-nested-partial",
        _enabled_by_other_code(
            functools.partial(functools.partial(checkpoint, use_reentrant=True), preserve_rng_state=False)
        ),
        True,
    ),
    ("own-plain-checkpoint", _enabled_by_other_code(checkpoint), True),
    ("own-closure", _enabled_by_other_code(_closure), True),
    ("own-non-reentrant", _enabled_by_other_code(functools.partial(checkpoint, use_reentrant=False)), False),
]


@pytest.mark.parametrize("how, reentrant", [case[1:] for case in ENABLERS], ids=[case[0] for case in ENABLERS])
def test_every_checkpoint_function(how, reentrant, monkeypatch, diversions):
    model = tiny_llama(layers=2)
    ids = input_ids(model)
    reference = keyword_driven_grads(model, ids)

    if callable(how):
        how(model)
    elif isinstance(how, tuple):
        if VERSION < Version("5.17"):
            pytest.skip("version rule: the offload closure exists from transformers 5.17")
        enable_checkpointing(model, how[0], **_offload_on_cpu(monkeypatch))
        assert model.model.layers[0]._gradient_checkpointing_func.func.__name__ == "checkpoint_func"
    else:
        enable_checkpointing(model, how)
    function = model.model.layers[0]._gradient_checkpointing_func
    assert is_reentrant(function) is reentrant
    assert isinstance(function, LayerCheckpoint) is reentrant, "only a reentrant function is handed on as ours"

    with shim.disabled(*UPSTREAM):
        upstream = keyword_driven_grads(model, ids)
    patched = keyword_driven_grads(model, ids)

    if reentrant:
        assert wrong_grads(reference, upstream), "bug: upstream drops the keyword tensors' gradients"
        assert diversions() == 2
    else:
        assert wrong_grads(reference, upstream) == []
        assert diversions() == 0, "non-reentrant calls must go straight through"
    assert wrong_grads(reference, patched) == []
    # every layer holds the one function the enable handed out, untouched by the calls
    assert all(layer.__dict__["_gradient_checkpointing_func"] is function for layer in model.model.layers)


# -- any mix of positional, keyword and nested inputs -------------------------------------------

Pair = collections.namedtuple("Pair", "scale shift")


class Mixer(GradientCheckpointingLayer):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)
        self.mlp = torch.nn.Linear(4, 4)

    def forward(self, x, y=None, pair=None, extra=None, factor=1.0):
        out = self.first(x)
        if y is not None:
            out = out + self.second(y)
        if pair is not None:
            out = out * pair[0] + pair[1]
        if extra is not None:
            out = out + extra["u"] * extra["v"][0] - extra["v"][1]
        return self.mlp(torch.tanh(out)) * factor


NAMES = ("x", "y", "s", "t", "u", "v0", "v1")
kinds = st.sampled_from(["constant", "leaf", "computed"])


def build(spec):
    """Fresh inputs for one run (same values every time): positional args, kwargs, leaves to compare."""
    generator = torch.Generator().manual_seed(7)
    source = torch.randn(2, 4, generator=generator).requires_grad_()
    leaves = {"source": source}
    values = {}
    for name in NAMES:
        value = torch.randn(2, 4, generator=generator)
        kind = spec["kinds"][name]
        if kind == "leaf":
            value.requires_grad_()
            leaves[name] = value
        elif kind == "computed":
            value = value * source  # a non-leaf that requires grad, like hidden states
        values[name] = value
    container = {"tuple": tuple, "list": list, "namedtuple": lambda items: Pair(*items)}[spec["pair"]]
    arguments = {
        "x": values["x"],
        "y": values["x"] if spec["shared"] else values["y"],
        "pair": container([values["s"], values["t"]]),
        "extra": {"u": values["u"], "v": [values["v0"], values["v1"]]} if spec["extra"] else None,
    }
    order = ("x", "y", "pair", "extra")
    args = tuple(arguments[name] for name in order[: spec["positional"]])
    kwargs = {name: arguments[name] for name in order[spec["positional"] :]}
    kwargs["factor"] = 0.5
    return args, kwargs, leaves


def run(spec, checkpointing):
    torch.manual_seed(0)
    layer = Mixer()
    layer.train()
    if checkpointing is not None:
        enable_on(layer, functools.partial(checkpoint, use_reentrant=checkpointing))
    args, kwargs, leaves = build(spec)
    output = layer(*args, **kwargs)
    output.square().sum().backward()
    tensors = {**{f"param {n}": p for n, p in layer.named_parameters()}, **leaves}
    return output.detach(), {name: tensor.grad for name, tensor in tensors.items()}


def requires_grad_somewhere(spec):
    used = {"x", "s", "t"} | ({"y"} if not spec["shared"] else set()) | ({"u", "v0", "v1"} if spec["extra"] else set())
    return any(spec["kinds"][name] != "constant" for name in used)


def upstream_is_wrong(spec, reentrant, expected):
    with shim.disabled(*UPSTREAM):
        try:
            upstream = run(spec, reentrant)[1]
        except RuntimeError:  # "element 0 of tensors does not require grad": nothing reached the output
            return True
    return any(
        (got is None) != (want is None) or (got is not None and not torch.allclose(got, want))
        for got, want in zip(upstream.values(), expected.values())
    )


specs = st.fixed_dictionaries(
    {
        "kinds": st.fixed_dictionaries({name: kinds for name in NAMES}),
        "positional": st.integers(0, 4),
        "pair": st.sampled_from(["tuple", "list", "namedtuple"]),
        "extra": st.booleans(),
        "shared": st.booleans(),
    }
).filter(requires_grad_somewhere)  # reentrant checkpointing needs one input that requires grad


MEASURED = {  # hidden states by keyword, like the measured Llama case
    "kinds": dict.fromkeys(NAMES, "constant") | {"x": "computed"},
    "positional": 0,
    "pair": "tuple",
    "extra": False,
    "shared": False,
}
NESTED_ONLY = {  # the only grad-requiring tensor sits in a dict's list, by keyword
    "kinds": dict.fromkeys(NAMES, "constant") | {"v0": "computed"},
    "positional": 2,
    "pair": "namedtuple",
    "extra": True,
    "shared": False,
}


@settings(max_examples=40, deadline=None)
@given(spec=specs, reentrant=st.booleans())
@example(spec=MEASURED, reentrant=True)
@example(spec=NESTED_ONLY, reentrant=True)
def test_any_mix_of_inputs_matches_no_checkpointing(spec, reentrant):
    # torch's reentrant contract: of the positional arguments only top-level tensors are inputs.
    # A tensor nested in a positional tuple loses its gradient with or without keywords; that is
    # torch's documented limit, not this bug, and the patch passes positional arguments as they are.
    args, _, _ = build(spec)
    assume(not (reentrant and any(not isinstance(a, torch.Tensor) and wants_grad(a) for a in args)))
    expected_output, expected = run(spec, None)

    before = runtime.count(NAME)
    output, grads = run(spec, reentrant)
    lifted = runtime.count(NAME) - before
    if reentrant and spec in (MEASURED, NESTED_ONLY):
        assert upstream_is_wrong(spec, reentrant, expected), "bug: upstream drops the keyword tensor's gradient"

    torch.testing.assert_close(output, expected_output)
    for name, want in expected.items():
        if want is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], want, msg=name)
    _, kwargs, _ = build(spec)
    keyword_grads = any(wants_grad(value) for value in kwargs.values())
    assert lifted == (1 if reentrant and keyword_grads else 0)


def test_non_grad_paths_are_untouched(diversions):
    args, kwargs, _ = build({**MEASURED, "kinds": dict.fromkeys(NAMES, "computed")})
    layer = Mixer()
    enable_on(layer, functools.partial(checkpoint, use_reentrant=True))
    layer.eval()
    layer(*args, **kwargs)
    layer.train()
    with torch.no_grad():
        layer(*args, **kwargs)
    layer.gradient_checkpointing = False
    layer(*args, **kwargs)
    assert diversions() == 0


def test_the_layers_function_is_untouched_when_the_layer_raises(diversions):
    layer = Mixer()
    layer.train()
    enable_on(layer, functools.partial(checkpoint, use_reentrant=True))
    function = layer.__dict__["_gradient_checkpointing_func"]
    x = torch.randn(2, 4, requires_grad=True) * 1
    with pytest.raises(RuntimeError):
        layer(x=x, y=torch.randn(3, 5))  # shape mismatch inside forward
    assert diversions() == 1
    assert layer.__dict__["_gradient_checkpointing_func"] is function


def test_the_function_a_layer_holds_reads_compares_pickles_and_copies_as_upstreams():
    import copy
    import pickle

    upstream = functools.partial(checkpoint, use_reentrant=True, preserve_rng_state=False)
    layer = Mixer()
    enable_on(layer, upstream)
    ours = layer._gradient_checkpointing_func
    assert isinstance(ours, LayerCheckpoint) and isinstance(ours, functools.partial)
    assert (ours.func, ours.args, ours.keywords) == (upstream.func, upstream.args, upstream.keywords)
    assert same_function(ours, upstream) and is_reentrant(ours)
    assert ours == upstream and upstream == ours and hash(ours) == hash(upstream) and ours is not upstream
    # Pickled or copied, it is what upstream's layer held: a model saved with the shim loads without it.
    assert pickle.dumps(ours) == pickle.dumps(upstream)
    unpickled = pickle.loads(pickle.dumps(ours))
    assert type(unpickled) is functools.partial and same_function(unpickled, upstream)
    assert type(copy.copy(ours)) is type(copy.deepcopy(ours)) is functools.partial
    # A layer copied or unpickled with the shim loaded is given its function again: the step is back.
    assert type(copy.deepcopy(layer)._gradient_checkpointing_func) is LayerCheckpoint
    assert type(pickle.loads(pickle.dumps(layer))._gradient_checkpointing_func) is LayerCheckpoint
    # handed out once: a second enable with it keeps it, a non-reentrant one is upstream's own
    enable_on(layer, ours)
    assert layer._gradient_checkpointing_func is ours
    non_reentrant = functools.partial(checkpoint, use_reentrant=False)
    enable_on(layer, non_reentrant)
    assert layer._gradient_checkpointing_func is non_reentrant


# -- recomputation, hooks, full model ----------------------------------------------------------


def count_calls(modules):
    counts = collections.Counter()
    handles = [m.register_forward_hook(lambda mod, i, o, key=key: counts.update([key])) for key, m in modules]
    return counts, handles


def test_layers_are_really_recomputed():
    model = tiny_llama(layers=2)
    ids = input_ids(model)
    layers = model.model.layers
    mlp_counts, handles = count_calls([(i, layer.mlp) for i, layer in enumerate(layers)])
    layer_counts, more = count_calls([(i, layer) for i, layer in enumerate(layers)])
    enable_checkpointing(model, {"use_reentrant": True})

    def counted(run):
        mlp_counts.clear(), layer_counts.clear()
        run()
        return dict(mlp_counts), dict(layer_counts)

    def positional():  # the call upstream gets right
        model.zero_grad()
        hidden = model.model.embed_tokens(ids)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        embeddings = model.model.rotary_emb(hidden, positions)
        for layer in layers:
            hidden = layer(hidden, position_ids=positions, position_embeddings=embeddings)
        hidden.sum().backward()

    with shim.disabled(*UPSTREAM):
        upstream_mlp, _ = counted(lambda: keyword_driven_grads(model, ids))
    patched_mlp, patched_layer = counted(lambda: keyword_driven_grads(model, ids))
    positional_mlp, positional_layer = counted(positional)
    for handle in handles + more:
        handle.remove()

    assert upstream_mlp == {0: 1, 1: 1}, "bug: upstream never recomputes (nothing needs a gradient)"
    assert patched_mlp == {0: 2, 1: 2}  # forward, then the recomputation in backward
    assert positional_mlp == patched_mlp
    # hooks on the layer itself fire as for a positional call: twice up to 5.22, once from 5.23
    # (checkpointing wraps forward, the recomputation calls it directly)
    assert patched_layer == positional_layer == dict.fromkeys((0, 1), 2 if VERSION < Version("5.23") else 1)


@pytest.mark.parametrize("reentrant", [True, False])
def test_full_model_steps_unchanged(reentrant, diversions):
    def step():
        model = tiny_llama(layers=2)
        enable_checkpointing(model, {"use_reentrant": reentrant})
        ids = input_ids(model)
        model(ids, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    with shim.disabled(*UPSTREAM):
        upstream = step()
    patched = step()
    assert diversions() == 0, "transformers' own model calls must not be diverted"
    for name, grad in upstream.items():
        assert grad is not None and torch.equal(patched[name], grad), name


def test_dropout_gradients_match_with_preserved_rng_state(device):
    """On CUDA the recomputation's dropout masks come from the CUDA generator's state, which torch
    saves and restores for it."""
    model = device.put(tiny_llama(layers=2, attention_dropout=0.5, attn_implementation="eager"))
    ids = device.put(input_ids(model))
    tolerance = device.tolerance()
    reference = keyword_driven_grads(model, ids, seed=3)
    again = keyword_driven_grads(model, ids, seed=4)
    assert wrong_grads(reference, again, **tolerance), "dropout must actually change the gradients"

    enable_checkpointing(model, {"use_reentrant": True, "preserve_rng_state": True})
    with shim.disabled(*UPSTREAM):
        assert wrong_grads(reference, keyword_driven_grads(model, ids, seed=3), **tolerance), "bug upstream"
    assert wrong_grads(reference, keyword_driven_grads(model, ids, seed=3), **tolerance) == []

    # and the RNG state matters: without preserving it the recomputation draws other masks
    enable_checkpointing(model, {"use_reentrant": True, "preserve_rng_state": False})
    assert wrong_grads(reference, keyword_driven_grads(model, ids, seed=3), **tolerance)


# -- rules, shape check, removal -----------------------------------------------------------------------


def test_reentrant_rule():
    assert is_reentrant(checkpoint)  # torch's default when the keyword is not given
    assert is_reentrant(functools.partial(checkpoint, preserve_rng_state=False))
    assert is_reentrant(functools.partial(checkpoint, use_reentrant=None))
    assert not is_reentrant(functools.partial(checkpoint, use_reentrant=False))
    outer_wins = functools.partial(functools.partial(checkpoint, use_reentrant=True), use_reentrant=False)
    assert not is_reentrant(outer_wins)
    assert is_reentrant(_closure)


def test_the_shape_check_detects_a_changed_call_shape(monkeypatch):
    class Changed(torch.nn.Module):
        gradient_checkpointing = False

        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(lambda *a: super(Changed, self).__call__(*a, **kwargs), *args)
            return super().__call__(*args, **kwargs)

    assert "functools.partial" in check(Changed)


def test_no_class_level_layer_and_deactivate_restores_the_layers_class():
    run_python(
        """
        import torch, transformers.modeling_layers as layers, transformers.modeling_utils as utils
        layer_class = layers.GradientCheckpointingLayer
        call, forward = vars(layer_class).get("__call__"), torch.nn.Module.__call__
        before = dict(vars(layer_class))
        import shim
        from tests.engine_state import shim_wrapper
        assert shim.registry.is_on("reentrant-keyword-grads") and shim.registry.is_on("reentrant-frozen-input-grads")
        # nothing of the shim's on the layer's call path
        assert vars(layer_class).get("__call__") is call and torch.nn.Module.__call__ is forward
        slot = vars(layer_class)["_gradient_checkpointing_func"]  # the assignments of the function
        assert shim_wrapper(slot, "reentrant-keyword-grads") is not None
        assert shim_wrapper(slot, "reentrant-frozen-input-grads") is not None  # stacked on it
        shim.deactivate()
        assert dict(vars(layer_class)) == before
        shim.activate()
        assert shim.registry.is_on("reentrant-keyword-grads")
        """,
        torch_first=True,
    )


def test_reentrant_keyword_grads_counts_diverted_layer_calls_only(ledger):
    torch.manual_seed(0)
    model = stock_tiny_llama(layers=3)
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
