# One-rank DeepSpeed ZeRO-3 runs of a Linear inside torch's CheckpointWrapper, with and without axolotl's fix
# of the same bug (its CheckpointWrapper.__setattr__, played by tests/coexistence/patchers.py), the shim's
# zero3-delegating-wrapper-hooks on or off. Driven by tests/e2e/test_coexistence.py, the cases one after the
# other in one process (tests/e2e/ranks.py):
#
#     python tests/e2e/checkpoint_wrapper.py LOG_DIR "NAME: {plain,checkpoint-wrapper} [--axolotl] [--shim-off P]"
#
# Each case writes LOG_DIR/NAME/wrapper-rank0.json: the losses, the trained weights (gathered) and what the
# shim's status says of other patchers on the patch.
import argparse
import os
import socket

import deepspeed
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import shim  # the DeepSpeed patch applies at once: deepspeed is imported
from shim.patches._deepspeed_cases import CONFIG, WIDTH
from tests.coexistence.patchers import axolotl_checkpoint_wrapper_setattr
from tests.e2e.ranks import Report, run_cases

PATCH = "zero3-delegating-wrapper-hooks"
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.body(x))


def train(case: argparse.Namespace, directory: str) -> None:
    report = Report(directory, "wrapper-rank")
    axolotl = axolotl_checkpoint_wrapper_setattr() if case.axolotl else None
    try:
        with deepspeed.zero.Init(config_dict_or_path=CONFIG):
            model = Net()
        if case.model == "checkpoint-wrapper":  # as accelerate and axolotl wrap a loaded model's modules
            model.head = checkpoint_wrapper(model.head)
        others = [other for status in shim.status() if status.name == PATCH for other in status.others]
        report.write(losses=[], others=others)
        engine, *_ = deepspeed.initialize(model=model, config=CONFIG, model_parameters=list(model.parameters()))
        torch.manual_seed(0)
        inputs = torch.randn(2, WIDTH)
        losses = []
        for _ in range(STEPS):
            loss = engine(inputs).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = {}
        for name, parameter in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([parameter]):
                weights[name.replace("_checkpoint_wrapped_module.", "")] = parameter.detach().flatten().tolist()
        calls = axolotl.calls if axolotl else None
        report.write(losses=losses, weights=weights, others=others, axolotl_setattr_calls=calls)
    finally:
        if axolotl is not None:
            axolotl.undo()


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="checkpoint_wrapper.py CASE")
    parser.add_argument("model", choices=("plain", "checkpoint-wrapper"))
    parser.add_argument("--axolotl", action="store_true", help="axolotl's CheckpointWrapper.__setattr__ on")
    return parser


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


if __name__ == "__main__":
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", free_port())
    deepspeed.init_distributed(dist_backend="gloo")
    run_cases(options(), train)
