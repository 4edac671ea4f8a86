# transformers' Trainer under plain DDP (no DeepSpeed) on CPU ranks, with a model that is no PreTrainedModel, so
# that the Trainer picks find_unused_parameters=True when left unset. Driven by tests/e2e/test_ddp_unused.py:
#
#     torchrun --nproc_per_node 2 tests/e2e/ddp_trainer.py CASE LOG_DIR \
#         [--checkpointing {reentrant,off}] [--accumulation N] [--max-steps N]
#
# CASE is where the trainable parameters sit:
#   lora           PEFT LoRA in every decoder layer (all used every step)
#   lora-unused    the same, plus a trainable head the forward never uses
#   lora-step      the same, the head used on every other forward only (the same on every rank)
#   frozen-unused  frozen embeddings and decoder layers, a trainable lm_head, a trainable head never used
#   frozen-step    the same, the head used on every other forward only
#
# Each rank writes LOG_DIR/ddp-rank<R>.json: the loss of every optimizer step, the find_unused_parameters and
# static_graph DDP was built with, the shim's patch states and effects, the library versions, and the error
# (first line) if training raised.
import argparse
import json
import os
import traceback
from importlib.metadata import version

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import shim  # as for a user (SHIM_DISABLE switches patches off)

VOCAB = 64
LENGTH = 12
HIDDEN = 32


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, config)


class WithHead(torch.nn.Module):
    """A model and a trainable head on its last hidden state, used never or on every other forward."""

    def __init__(self, model, head_used: str) -> None:
        super().__init__()
        self.model = model
        torch.manual_seed(2)
        self.head = torch.nn.Linear(HIDDEN, 1)
        self.head_used = head_used
        self.forwards = 0

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs):
        if hasattr(self.model, "activation_checkpointing_enable"):
            return self.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=activation_checkpointing_kwargs, **kwargs
            )
        return self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=activation_checkpointing_kwargs, **kwargs
        )

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        """The name the Trainer calls before transformers 5.23."""
        return self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def forward(self, input_ids, labels=None, **kwargs):
        use = self.head_used == "step" and self.forwards % 2 == 1
        self.forwards += 1
        output = self.model(input_ids=input_ids, labels=labels, output_hidden_states=use)
        loss = output.loss
        if use:
            loss = loss + 0.1 * self.head(output.hidden_states[-1]).pow(2).mean()
        return {"loss": loss}


def frozen_llama():
    model = llama()
    model.requires_grad_(False)
    model.lm_head.requires_grad_(True)
    return model


def build(case: str):
    if case == "lora":
        return lora(llama())
    if case in ("lora-unused", "lora-step"):
        return WithHead(lora(llama()), case.partition("-")[2])
    if case in ("frozen-unused", "frozen-step"):
        return WithHead(frozen_llama(), case.partition("-")[2])
    raise SystemExit(f"unknown case {case}")


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (64, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StepLog(TrainerCallback):
    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"ddp-rank{os.environ.get('RANK', '0')}.json")
        self.trainer = None
        self.losses: list[float] = []
        self.error = None

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
            "error": self.error,
            "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
            "static_graph": getattr(wrapped, "static_graph", None),
            "shim": {patch.name: patch.state for patch in shim.status()},
            "effects": {patch.name: patch.effects for patch in shim.status() if patch.effects},
            "versions": {name: version(name) for name in ("transformers", "peft", "accelerate", "torch")},
        }
        with open(self.path, "w") as handle:
            json.dump(report, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("log_dir")
    parser.add_argument("--checkpointing", choices=("reentrant", "off"), default="reentrant")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=3)
    cli = parser.parse_args()

    args = TrainingArguments(
        output_dir=os.path.join(cli.log_dir, "output"),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=cli.accumulation,
        max_steps=cli.max_steps,
        learning_rate=1e-2,
        gradient_checkpointing=cli.checkpointing == "reentrant",
        gradient_checkpointing_kwargs={"use_reentrant": True} if cli.checkpointing == "reentrant" else None,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    log = StepLog(cli.log_dir)
    trainer = Trainer(model=build(cli.case), args=args, train_dataset=Rows(), callbacks=[log])
    log.trainer = trainer
    try:
        trainer.train()
    except Exception as error:
        log.error = traceback.format_exception_only(error)[-1].strip()[:300]
        log.write()
        raise
    log.write()
    if trainer.is_world_process_zero():
        print(f"done: {trainer.state.global_step} optimizer steps", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
