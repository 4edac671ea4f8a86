# A PEFT LoRA Llama with dropout active (LoRA dropout 0.3, attention dropout 0.1), trained a few steps under
# FSDP2 through accelerate's own Accelerator.prepare (fsdp2_apply_ac, then fully_shard) on CPU ranks over
# gloo. Driven by tests/e2e/test_fsdp2.py:
#
#     torchrun --nproc_per_node 2 tests/e2e/fsdp2_lora.py LOG_DIR [--checkpointing {on,off}] [--steps N]
#
# Each rank writes LOG_DIR/fsdp2-rank<R>.json: every step's loss and gradient norm, the preserve_rng_state of
# every checkpoint wrapper, the shim's patch states and effects, the library versions.
#
# accelerate selects FSDP only on accelerator devices: on CPU ranks an Accelerator with an FSDP plugin reads
# as MULTI_CPU. The script sets the state's distributed type to FSDP and hands it the plugin right after
# building the Accelerator, so that prepare() runs its FSDP2 path as on GPUs. (transformers' Trainer takes
# the same path but decides FSDP from that state when it builds its Accelerator: it cannot be run on CPU.)
import shim  # noqa: I001  (first, as for a user; SHIM_DISABLE switches patches off)

import argparse
import json
import os
from importlib.metadata import version

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


def build_model():
    torch.manual_seed(0)  # the same weights on every rank: fully_shard keeps each rank's shard of them
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attention_dropout=0.1,
        use_cache=False,  # as a training script sets it: transformers 4.x builds a cache when training
    )
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(LlamaForCausalLM(config), lora)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir")
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    parser.add_argument("--steps", type=int, default=3)
    cli = parser.parse_args()

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        activation_checkpointing=cli.checkpointing == "on",
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2, "the FSDP2 path of prepare() must run"

    model = build_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()

    rank = accelerator.process_index
    data = torch.Generator().manual_seed(1 + rank)
    torch.manual_seed(100 + rank)  # the dropout masks: different per rank, the same in every run
    losses, grad_norms = [], []
    for _ in range(cli.steps):
        input_ids = torch.randint(0, VOCAB, (2, 12), generator=data)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    report = {
        "losses": losses,
        "grad_norms": grad_norms,
        "preserve_rng_state": [
            module.checkpoint_fn.keywords.get("preserve_rng_state")
            for module in model.modules()
            if isinstance(module, CheckpointWrapper)
        ],
        "shim": {patch.name: patch.state for patch in shim.status()},
        "effects": {patch.name: patch.effects for patch in shim.status() if patch.effects},
        "versions": {name: version(name) for name in ("accelerate", "transformers", "peft", "torch")},
    }
    with open(os.path.join(cli.log_dir, f"fsdp2-rank{rank}.json"), "w") as handle:
        json.dump(report, handle, indent=1)
    if accelerator.is_main_process:
        print(f"done: {cli.steps} optimizer steps", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
