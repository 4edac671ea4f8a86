"""``DistributedDataParallel(find_unused_parameters=True)`` on 2 gloo CPU ranks, a model with a
parameter unused on some steps: ``python tests/do_no_harm/workflows/ddp.py CASE ...``.

This process is rank 0; rank 1 is a child forked from it once the shim is imported (as
``torch.multiprocessing`` starts workers on Linux), so it needs no imports of its own. The model is a
tiny Llama whose decoder layer 1 has a branch (``tests.tinymodels.add_branch``) off on the first step
(its parameter unused) and on for the second. Cases, by checkpointing: ``none``,
``non-reentrant`` (reentrant checkpointing with ``find_unused_parameters=True`` fails upstream:
``Expected to mark a variable ready only once``). Each record holds both ranks' losses and weight
digests after the two steps.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time

import torch

import shim  # noqa: F401  (as a training script starts; SHIM_DISABLE=all makes it the run without)
from tests import devices, tinymodels
from tests import steps as tinysteps
from tests import tinymodels as testmodels
from tests.do_no_harm.workflows import MARK, digest, error_of, input_ids, quiet, weights

WORLD = 2


def train(checkpointing: str, rank: int) -> dict:
    torch.manual_seed(0)
    model = tinymodels.tiny_llama(2)
    branch = testmodels.add_branch(model, 1)
    model.train()
    if checkpointing != "none":
        tinysteps.enable_checkpointing(model, {"use_reentrant": checkpointing == "reentrant"})
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = input_ids(vocab=model.config.vocab_size, device=devices.CPU) + rank  # each rank its own batch (gloo: CPU)
    ids = ids % model.config.vocab_size
    losses = []
    for active in (False, True):
        branch.active = active
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": digest(weights(model))}


def rank_main(rank: int, init: str, names: list, out: str) -> dict:
    import torch.distributed as dist

    quiet()
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    results = {}
    try:
        for name in names:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                results[name] = {"ok": True, "error": None, **train(name, rank)}
            except Exception as exc:
                results[name] = {"ok": False, "error": error_of(exc)}
            results[name]["seconds"] = round(time.perf_counter() - start, 2)
            results[name]["cpu"] = round(time.process_time() - cpu, 2)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out, "w") as handle:
        json.dump(results, handle)
    return results


def both_ranks(names: list) -> dict:
    quiet()  # one thread before forking
    import torch.distributed  # noqa: F401  (what both ranks need, imported once, before the fork)
    import transformers.models.llama.modeling_llama  # noqa: F401

    with tempfile.TemporaryDirectory() as folder:
        init = "file://" + os.path.join(folder, "rendezvous")
        outputs = [os.path.join(folder, f"rank{rank}.json") for rank in range(WORLD)]
        other = multiprocessing.get_context("fork").Process(
            target=rank_main, args=(1, init, names, outputs[1]), daemon=True
        )
        other.start()
        try:
            rank_main(0, init, names, outputs[0])
        finally:
            other.join(120)
            if other.is_alive():
                other.kill()
        ranks = []
        for path in outputs:
            with open(path) as handle:
                ranks.append(json.load(handle))
    not_data = ("ok", "error", "seconds", "cpu")
    return {
        name: {
            "ok": all(r[name]["ok"] for r in ranks),
            "error": next((r[name]["error"] for r in ranks if r[name]["error"]), None),
            "ranks": [{k: v for k, v in r[name].items() if k not in not_data} for r in ranks],
            "seconds": ranks[0][name]["seconds"],
            "cpu": ranks[0][name]["cpu"],
        }
        for name in names
    }


if __name__ == "__main__":
    print(MARK + json.dumps(both_ranks(sys.argv[1:])), flush=True)
