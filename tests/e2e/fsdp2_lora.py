# A PEFT LoRA Llama with dropout active (LoRA dropout 0.3, attention dropout 0.1), trained a few steps under
# FSDP2 through accelerate's own Accelerator.prepare (fsdp2_apply_ac, then fully_shard) on CPU ranks over
# gloo. Driven by tests/e2e/test_fsdp2.py, several cases one after the other in one process group
# (tests/e2e/ranks.py):
#
#     torchrun --nproc_per_node 2 tests/e2e/fsdp2_lora.py LOG_DIR "NAME: [--checkpointing {on,off}] [--steps N]
#         [--shim-off PATCH]" ...
#
# Each rank writes LOG_DIR/NAME/fsdp2-rank<R>.json: every step's loss and gradient norm, the preserve_rng_state
# of every checkpoint wrapper, the shim's patch states and effects, the library versions.
#
# accelerate selects FSDP only on accelerator devices: on CPU ranks an Accelerator with an FSDP plugin reads
# as MULTI_CPU. The script sets the state's distributed type to FSDP and hands it the plugin right after
# building the Accelerator, so that prepare() runs its FSDP2 path as on GPUs. (transformers' Trainer takes
# the same path but decides FSDP from that state when it builds its Accelerator: it cannot be run on CPU.)
import shim  # noqa: F401, I001  (first, as for a user; a case's --shim-off switches patches off around it)

import argparse

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from tests.e2e.ranks import VOCAB, Report, run_cases, tiny_llama, with_lora


def build_model():
    # The same weights on every rank: fully_shard keeps each rank's shard of them.
    # use_cache=False as a training script sets it: transformers 4.x builds a cache when training.
    return with_lora(tiny_llama(attention_dropout=0.1, use_cache=False), lora_dropout=0.3)


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp2_lora.py CASE")
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    parser.add_argument("--steps", type=int, default=3)
    return parser


def train(case: argparse.Namespace, directory: str) -> None:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        activation_checkpointing=case.checkpointing == "on",
        state_dict_type="SHARDED_STATE_DICT",
    )
    # Each case its own accelerate state (the FSDP one set by hand below); the process group stays.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2, "the FSDP2 path of prepare() must run"

    report = Report(directory, "fsdp2-rank")
    model = build_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()

    rank = accelerator.process_index
    data = torch.Generator().manual_seed(1 + rank)
    torch.manual_seed(100 + rank)  # the dropout masks: different per rank, the same in every case
    losses, grad_norms = [], []
    for _ in range(case.steps):
        input_ids = torch.randint(0, VOCAB, (2, 12), generator=data)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    report.write(
        losses=losses,
        grad_norms=grad_norms,
        preserve_rng_state=[
            module.checkpoint_fn.keywords.get("preserve_rng_state")
            for module in model.modules()
            if isinstance(module, CheckpointWrapper)
        ],
    )
    if accelerator.is_main_process:
        print(f"done: {case.steps} optimizer steps", flush=True)


if __name__ == "__main__":
    run_cases(options(), train)
