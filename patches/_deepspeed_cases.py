"""A one-rank DeepSpeed ZeRO-3 case: what ``zero3-frozen-recompute``'s bug probe asks with the patch on
(only a ZeRO-3 run shows whether the bug is gone).

DeepSpeed needs ``torch.distributed``; ``python -m shim doctor`` must not initialise it in its own
process, so the case runs in a child process (one rank, gloo on CPU) with the patch switched on or
off as it is in the doctor's process, and reports the exception it ended with::

    python -m shim.patches._deepspeed_cases frozen-recompute

The first run of a fresh environment JIT-builds DeepSpeed's CPU communication op (a minute or two,
kept in ``TORCH_EXTENSIONS_DIR``); later runs take a few seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

MARKER = "shim-deepspeed-case: "
TIMEOUT = 900  # a cold first run compiles DeepSpeed's CPU comm op
#: What each case's exception says when the bug shows.
SIGNATURES = {
    "frozen-recompute": ("CheckpointError", "torch.Size([0])"),
}
WIDTH = 8
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_allow_untested_optimizer": True,
}


def reproduces(case: str, patch: str) -> bool:
    """Run ``case`` on one rank in a child process, with ``patch`` switched as it is here; ``True`` when it
    ends with the bug's exception, ``False`` when it trains. Anything else raises (a doctor "check error")."""
    import shim

    env = dict(os.environ) | one_rank_environment()
    env["SHIM_DISABLE"] = "" if shim.registry.is_on(patch) else patch
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__, case], env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{case}: the one-rank DeepSpeed run took more than {TIMEOUT} s") from exc
    lines = [line[len(MARKER) :] for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"{case}: the one-rank DeepSpeed run exited {done.returncode} without a result:\n{tail}")
    error = json.loads(lines[-1])["error"]
    if error is None:
        return False
    if all(part in error for part in SIGNATURES[case]):
        return True
    raise RuntimeError(f"{case}: the one-rank DeepSpeed run failed otherwise: {error}")


def one_rank_environment() -> dict[str, str]:
    """What ``torch.distributed`` needs to start a process group of this one process, on a free port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    return dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )


# -- the child ---------------------------------------------------------------------------------


def train(model, steps: int = 2) -> tuple[object, list[float]]:
    """``steps`` ZeRO-3 steps of ``model`` on one fixed batch; the engine and each step's loss."""
    import deepspeed
    import torch

    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG, model_parameters=trainable)
    torch.manual_seed(0)
    inputs = torch.randn(2, WIDTH)
    losses = []
    for _ in range(steps):
        loss = engine(inputs).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def frozen_recompute() -> None:
    """Two blocks of frozen LayerNorm + trainable Linear, each under non-reentrant checkpointing."""
    import deepspeed
    import torch
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.linear = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.linear(self.norm(x))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = Net()
    for block in model.blocks:
        block.norm.requires_grad_(False)
    train(model)


CASES = {"frozen-recompute": frozen_recompute}


def main(argv: list[str]) -> int:
    import deepspeed

    run = CASES[argv[0]]
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        run()
        error = None
    except Exception as exc:  # the case's outcome, reported to the parent
        error = f"{type(exc).__name__}: {exc}"
    print(MARKER + json.dumps({"error": error}), flush=True)
    return 0


if __name__ == "__main__":
    import shim  # noqa: F401  -- first, as for a user; SHIM_DISABLE says whether the patch is on

    sys.exit(main(sys.argv[1:]))
