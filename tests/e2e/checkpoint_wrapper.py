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

import deepspeed
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import shim  # the DeepSpeed patch applies at once: deepspeed is imported
from shim.patches._deepspeed_cases import CONFIG, WIDTH, one_rank_environment
from shim.patches._deepspeed_cases import train as zero3_steps
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
        engine, losses = zero3_steps(model, STEPS)  # the self-check's loop: every parameter trains
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


if __name__ == "__main__":
    for name, value in one_rank_environment().items():
        os.environ.setdefault(name, value)
    deepspeed.init_distributed(dist_backend="gloo")
    run_cases(options(), train)
