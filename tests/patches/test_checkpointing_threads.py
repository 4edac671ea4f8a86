"""Threads never share a checkpoint function: a layer only ever holds its own model's.

Two threads at once, each with its own layers and its own reentrant function (``partial(checkpoint,
use_reentrant=True, preserve_rng_state=True)`` in one, ``preserve_rng_state=False`` in the other),
give their layers their function over and over and read each back. Every read must carry the
thread's own function and keywords: compared by ``.func`` and ``.keywords``, not by identity (the
layer may hold an object of the shim's that reads as the function). Without the shim none ever
differs; today's shim hands a layer the other thread's function now and then (it remembers the last
function it wrapped, and reads that memory twice), silently: a layer checkpoints without the RNG
state its user asked for.

``sys.setswitchinterval`` is set small so that threads switch often; the threads are daemons joined
with a timeout, so a hang fails the test instead of the suite.
"""

import functools
import sys
import threading

import pytest
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import shim
from tests.steps import enable_checkpointing
from tests.tinymodels import tiny_llama, tiny_llama_config

TIMEOUT = 60  # seconds for the two threads together; each test takes a few


def race(work, count: int) -> list:
    """``work(index, count, start, stop, wrong)`` in two threads at once (``index`` 0 and 1), 1 µs
    switch interval; the two threads' lists of wrong reads. Each waits for ``start`` (a barrier);
    ``stop`` is set when either thread ends."""
    wrong = [[], []]
    start, stop = threading.Barrier(2), threading.Event()

    def run(index):
        try:
            work(index, count, start, stop, wrong[index])
        finally:
            stop.set()

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in (0, 1)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads), f"the threads hung for {TIMEOUT} s"
    return wrong


def reentrant(preserve_rng_state: bool):
    return functools.partial(checkpoint, use_reentrant=True, preserve_rng_state=preserve_rng_state)


def differs(held, function) -> bool:
    """Whether what a layer holds does something else than ``function``."""
    return getattr(held, "func", None) is not function.func or getattr(held, "keywords", None) != function.keywords


ASSIGNMENTS = 60_000  # per thread, of 4 layers each: 480 000 reads


def test_two_threads_assigning_functions_to_their_layers_each_read_back_their_own():
    """``layer._gradient_checkpointing_func = f`` in a tight loop on each thread's own four decoder
    layers, each read back at once. Without the shim: none wrong; today's shim: 5 to 34 wrong reads,
    in every one of ten runs (2.4 to 4.7 s on the shared 2 cores)."""
    functions = [reentrant(True), reentrant(False)]
    layers = [[LlamaDecoderLayer(tiny_llama_config(), index) for index in range(4)] for _ in functions]

    def work(index, count, start, stop, wrong):
        function, own = functions[index], layers[index]
        start.wait()
        for _ in range(count):
            for layer in own:
                layer._gradient_checkpointing_func = function
                if differs(layer._gradient_checkpointing_func, function):
                    wrong.append(layer._gradient_checkpointing_func)

    with shim.disabled():
        upstream = race(work, ASSIGNMENTS // 10)
    assert upstream == [[], []], "without the shim, a thread reads another's function"
    wrong = race(work, ASSIGNMENTS)
    assert [len(reads) for reads in wrong] == [0, 0], [
        sorted({repr(getattr(read, "keywords", read)) for read in reads}) for reads in wrong
    ]


ENABLES = 2_000  # of an 8-layer model, beside the other thread's tight loop


def test_a_thread_enabling_checkpointing_beside_another_assigning_each_keep_their_own_kwargs():
    """One thread enables checkpointing on its own 8-layer model with ``{"use_reentrant": True,
    "preserve_rng_state": True}`` over and over (the public enable, as the Trainer and trl's cycle
    call it) and checks every layer after each; the other gives its own layers a function with
    ``preserve_rng_state=False`` in a tight loop, reading each back, until the first is done (the
    tight loop keeps the shim's memory changing: two enabling threads meet too rarely). Today's
    shim: some of the second thread's reads hold the first thread's keywords, now and then one of the
    first's layers the second's: 2 to 18 in every one of ten runs (2.9 to 6.2 s); with two enabling
    threads about 1 in 16 000 layers."""
    model = tiny_llama(8)
    kwargs = {"use_reentrant": True, "preserve_rng_state": True}
    other = reentrant(False)
    other_layers = [LlamaDecoderLayer(tiny_llama_config(), index) for index in range(4)]

    def work(index, count, start, stop, wrong):
        start.wait()
        if index == 0:
            for _ in range(count):
                enable_checkpointing(model, kwargs)
                for layer in model.model.layers:
                    if getattr(layer._gradient_checkpointing_func, "keywords", None) != kwargs:
                        wrong.append(layer._gradient_checkpointing_func)
            return
        while not stop.is_set():
            for layer in other_layers:
                layer._gradient_checkpointing_func = other
                if differs(layer._gradient_checkpointing_func, other):
                    wrong.append(layer._gradient_checkpointing_func)

    with shim.disabled():
        upstream = race(work, ENABLES // 10)
    assert upstream == [[], []], "without the shim, a thread reads another's kwargs"
    wrong = race(work, ENABLES)
    assert [len(reads) for reads in wrong] == [0, 0], [
        sorted({repr(getattr(read, "keywords", read)) for read in reads}) for reads in wrong
    ]


@pytest.fixture(autouse=True)
def quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the gradient_checkpointing_* names from 5.23
        yield
