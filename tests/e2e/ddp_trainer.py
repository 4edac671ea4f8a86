# transformers' Trainer under plain DDP (no DeepSpeed) on CPU ranks, with a model that is no PreTrainedModel, so
# that the Trainer picks find_unused_parameters=True when left unset. Driven by tests/e2e/test_ddp_unused.py,
# several cases one after the other in one process group (tests/e2e/ranks.py):
#
#     torchrun --nproc_per_node 2 tests/e2e/ddp_trainer.py LOG_DIR "NAME: MODEL [--checkpointing {reentrant,off}]
#         [--accumulation N] [--max-steps N] [--shim-off PATCH]" ...
#
# MODEL is where the trainable parameters sit:
#   lora           PEFT LoRA in every decoder layer (all used every step)
#   lora-unused    the same, plus a trainable head the forward never uses
#   lora-step      the same, the head used on every other forward only (the same on every rank)
#   frozen-unused  frozen embeddings and decoder layers, a trainable lm_head, a trainable head never used
#   frozen-step    the same, the head used on every other forward only
#
# Each rank writes LOG_DIR/NAME/ddp-rank<R>.json: the loss of every optimizer step, the find_unused_parameters
# and static_graph DDP was built with, the shim's patch states and effects, the library versions, and the error
# (first line) if training raised.
import argparse
import os

import torch
from transformers import Trainer, TrainingArguments

import shim  # noqa: F401  (as for a user; a case's --shim-off switches patches off around it)
from tests.e2e.ranks import HIDDEN, StepLog, TokenRows, run_cases, tiny_llama, with_lora


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
    model = tiny_llama()
    model.requires_grad_(False)
    model.lm_head.requires_grad_(True)
    return model


def build(model: str):
    if model == "lora":
        return with_lora(tiny_llama())
    if model in ("lora-unused", "lora-step"):
        return WithHead(with_lora(tiny_llama()), model.partition("-")[2])
    if model in ("frozen-unused", "frozen-step"):
        return WithHead(frozen_llama(), model.partition("-")[2])
    raise SystemExit(f"unknown model {model}")


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddp_trainer.py CASE")
    parser.add_argument("model")
    parser.add_argument("--checkpointing", choices=("reentrant", "off"), default="reentrant")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=3)
    return parser


def train(case: argparse.Namespace, directory: str) -> None:
    args = TrainingArguments(
        output_dir=os.path.join(directory, "output"),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=case.accumulation,
        max_steps=case.max_steps,
        learning_rate=1e-2,
        gradient_checkpointing=case.checkpointing == "reentrant",
        gradient_checkpointing_kwargs={"use_reentrant": True} if case.checkpointing == "reentrant" else None,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    log = StepLog(directory, "ddp-rank")
    log.train(Trainer(model=build(case.model), args=args, train_dataset=TokenRows(64), callbacks=[log]))


if __name__ == "__main__":
    run_cases(options(), train)
