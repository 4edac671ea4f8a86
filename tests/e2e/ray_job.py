"""A Ray Train job as a user writes it: ``import shim`` (where asked) in the driver only, a ``TorchTrainer``
with two CPU workers, each building a 2-layer Llama with reentrant checkpointing and calling its decoder
layers with ``hidden_states=`` by keyword (the case of ``reentrant-keyword-grads``, built with
tests/tinymodels.py and tests/steps.py: the workers have the checkout on ``PYTHONPATH``, as
tests/e2e/launch.py sets it). Each worker writes what it saw to ``<out>/worker-<rank>.json``: how many
gradients differ from the same model's without checkpointing, its node, whether the shim was imported
there and whether the user's own setup hook ran.

    python tests/e2e/ray_job.py OUT [--shim] [--address ADDR] [--users-hook]

Without ``--address`` the driver starts a local Ray bounded for a 2-core machine (two CPUs, a small object
store, no dashboard); with it, it joins that cluster. It always shuts Ray down before it ends.
"""

from __future__ import annotations

import argparse
import sys

OBJECT_STORE = 80 * 1024 * 1024


def users_hook() -> None:
    """A setup hook of the user's own: the workers must still run it."""
    import os

    os.environ["E2E_USERS_HOOK_RAN"] = "1"


def train_func(config: dict) -> None:
    import json
    import os
    import socket
    import sys
    import warnings

    import ray.train
    import torch
    import transformers

    from tests.steps import enable_checkpointing, keyword_driven_grads, wrong_grads
    from tests.tinymodels import tiny_llama  # the project's tiny Llama; the workers have the checkout on PYTHONPATH

    warnings.simplefilter("ignore")  # torch's "None of the inputs have requires_grad=True" is the bug speaking
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    model.train()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = keyword_driven_grads(model, input_ids)
    enable_checkpointing(model, {"use_reentrant": True})
    checkpointed = keyword_driven_grads(model, input_ids)
    wrong = wrong_grads(reference, checkpointed)
    rank = ray.train.get_context().get_world_rank()
    record = {
        "rank": rank,
        "wrong": len(wrong),
        "without_grad": sum(1 for name in wrong if checkpointed[name] is None),
        "tensors": len(reference),
        "node": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "shim": "shim" in sys.modules,
        "users_hook": os.environ.get("E2E_USERS_HOOK_RAN") == "1",
    }
    with open(os.path.join(config["out"], f"worker-{rank}.json"), "w") as file:
        json.dump(record, file)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shim", action="store_true", help="import shim first, as the README's quick start says")
    parser.add_argument("--address", help="join this cluster instead of starting a local one")
    parser.add_argument("--users-hook", action="store_true", help="give the job a worker_process_setup_hook of its own")
    args = parser.parse_args(argv)
    if args.shim:
        import shim  # noqa: F401  -- the one line the user adds

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    runtime_env = {"worker_process_setup_hook": users_hook} if args.users_hook else None
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env)
    else:
        ray.init(num_cpus=2, object_store_memory=OBJECT_STORE, include_dashboard=False, runtime_env=runtime_env)
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"out": args.out},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=args.out, name="run"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    print("e2e ray job: done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
