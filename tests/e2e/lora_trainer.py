# transformers' Trainer with a PEFT LoRA model on CPU ranks, under DeepSpeed ZeRO-3 or plain DDP, with the
# checkpointing configuration chosen on the command line. Driven by tests/e2e/test_distributed.py:
#
#     torchrun --nproc_per_node 2 tests/e2e/lora_trainer.py {zero3,ddp} LOG_DIR \
#         [--checkpointing {default,reentrant,non-reentrant,off}] [--modules-to-save lm_head] [--max-steps N]
#
# Each rank writes LOG_DIR/lora-rank<R>.json: the loss of every optimizer step, the shim's patch states, the
# find_unused_parameters and static_graph DDP was built with, and the library versions. "default" passes no
# checkpointing kwargs (transformers 5.x then checkpoints non-reentrantly).
import argparse
import json
import os
from importlib.metadata import version

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

import shim  # as for a user (SHIM_DISABLE switches patches off)

# ZeRO-3, fp32, the Trainer's torch AdamW as a client optimizer (as examples/gkd_zero3.py).
DEEPSPEED_CONFIG = {
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}

CHECKPOINTING = {
    "default": None,
    "reentrant": {"use_reentrant": True},
    "non-reentrant": {"use_reentrant": False},
}
VOCAB = 64
LENGTH = 12


def build_model(seed: int = 0):
    """A tiny Llama, built after the TrainingArguments so that under ZeRO-3 it is created partitioned."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config)


def dataset() -> Dataset:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (32, LENGTH), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


class StepLog(TrainerCallback):
    """Writes every optimizer step's loss and the run's set-up, one JSON file per rank."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"lora-rank{os.environ.get('RANK', '0')}.json")
        self.trainer = None
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.write()

    def on_train_begin(self, args, state, control, **kwargs):
        self.write()

    def write(self) -> None:
        wrapped = getattr(self.trainer, "model_wrapped", None)
        report = {
            "losses": self.losses,
            "shim": {patch.name: patch.state for patch in shim.status()},
            "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
            "static_graph": getattr(wrapped, "static_graph", None),
            "versions": {name: version(name) for name in ("deepspeed", "transformers", "peft", "torch")},
            "effects": {patch.name: patch.effects for patch in shim.status() if patch.effects},
        }
        with open(self.path, "w") as handle:
            json.dump(report, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=("zero3", "ddp"))
    parser.add_argument("log_dir")
    parser.add_argument("--checkpointing", choices=(*CHECKPOINTING, "off"), default="default")
    parser.add_argument("--modules-to-save", nargs="*", default=None)
    parser.add_argument("--max-steps", type=int, default=2)
    cli = parser.parse_args()

    args = TrainingArguments(
        output_dir=os.path.join(cli.log_dir, "output"),
        deepspeed=DEEPSPEED_CONFIG if cli.backend == "zero3" else None,
        use_cpu=cli.backend == "ddp",
        per_device_train_batch_size=2,
        max_steps=cli.max_steps,
        learning_rate=1e-2,
        gradient_checkpointing=cli.checkpointing != "off",
        gradient_checkpointing_kwargs=CHECKPOINTING.get(cli.checkpointing),
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=cli.modules_to_save,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(build_model(), lora)
    log = StepLog(cli.log_dir)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[log])
    log.trainer = trainer
    trainer.train()
    log.write()
    if trainer.is_world_process_zero():
        print(f"done: {trainer.state.global_step} optimizer steps", flush=True)
    if torch.distributed.is_initialized():
        # End the process group before the interpreter exits, so that no communication thread is still
        # running while the process tears down.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
