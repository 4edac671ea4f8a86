# On-policy distillation (trl's GKDTrainer) of a LoRA student under DeepSpeed ZeRO-3, on CPU.
#
#     torchrun --nproc_per_node 2 examples/gkd_zero3.py
#
# This is the run of trl issue #6827: with `gradient_checkpointing_kwargs={"use_reentrant": True}`,
# trl <= 1.15 re-enables gradient checkpointing after each generation *without* those kwargs, so
# transformers 5.x falls back to non-reentrant checkpointing; on a model with frozen (LoRA base)
# parameters under ZeRO-3 (DeepSpeed <= 0.19.2) the first backward dies with
# `CheckpointError: Recomputed values have different metadata than during the forward pass`.
# With `import shim` the configured kwargs are restored and training completes.
# `SHIM_DISABLE=all torchrun ...` shows the crash with the shim present but switched off.
# Without the `import shim` line, `shim-run torchrun --nproc_per_node 2 examples/gkd_zero3.py` applies the
# shim on every rank all the same.
#
# The code follows trl's GKD documentation (GKDConfig / GKDTrainer with a "messages" dataset);
# the models and the tokenizer are tiny and built in code so that it runs offline in seconds.
# Tested with deepspeed 0.19.2, trl 1.15.0, transformers 5.24.0, peft 0.21.2 (constraints/e2e.txt).
import argparse
import functools
import json
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, TrainerCallback
from trl.experimental.gkd import GKDConfig, GKDTrainer

import shim  # noqa: F401  -- the only change to trl's GKD example: fixes known bugs of the installed stack

CHECKPOINTING_KWARGS = {"use_reentrant": True}

# ZeRO-3, fp32, no DeepSpeed optimizer section: the Trainer's torch AdamW is used as a client optimizer.
DEEPSPEED_CONFIG = {
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}

WORDS = "hi hello how are you i am fine great thanks good what is your name my the a cat dog sat on mat".split()
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with a chat template, built in code (nothing is downloaded)."""
    vocab = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=64,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int, num_hidden_layers: int = 2):
    """A tiny Llama. Built with ``from_config`` after the GKDConfig exists, so that under ZeRO-3 it is
    created inside ``deepspeed.zero.Init`` (partitioned), as ``from_pretrained`` would."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return AutoModelForCausalLM.from_config(config)


def checkpointing_state(model) -> dict:
    """What the model's checkpointing modules actually hold: the keyword arguments of the
    ``functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)`` transformers sets on every
    checkpointing layer, and which layers checkpoint at all."""
    layers = []
    for name, module in model.named_modules():
        if hasattr(module, "gradient_checkpointing") and hasattr(module, "_gradient_checkpointing_func"):
            func = module._gradient_checkpointing_func
            partial = isinstance(func, functools.partial)
            layers.append(
                {
                    "name": name,
                    "enabled": bool(module.gradient_checkpointing),
                    "func": getattr(func.func if partial else func, "__qualname__", repr(func)),
                    "kwargs": dict(func.keywords) if partial else {},
                }
            )
    return {"layers": layers}


def shim_states() -> dict:
    """Each shim patch's state in this process ("suspended" inside a ``shim.disabled()`` block, where
    a patch keeps its state and its layers are off); empty when the shim is not loaded."""
    loaded = sys.modules.get("shim")
    if loaded is None:
        return {}
    return {patch.name: "suspended" if patch.suspended else patch.state for patch in loaded.status()}


class CheckpointingLog(TrainerCallback):
    """Writes the checkpointing state after the Trainer set it up and after every optimizer step,
    one JSON file per rank."""

    def __init__(self, directory: str, configured: dict):
        self.path = os.path.join(directory, f"checkpointing-rank{os.environ.get('RANK', '0')}.json")
        self.configured = configured
        self.records = []

    def _record(self, when, state, model):
        self.records.append({"when": when, "step": state.global_step, **checkpointing_state(model)})
        report = {
            "configured": self.configured,
            "shim": shim_states(),
            "records": self.records,
        }
        with open(self.path, "w") as handle:
            json.dump(report, handle, indent=1, default=repr)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._record("train_begin", state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._record("step_end", state, model)
        if args.process_index == 0:
            kwargs_now = sorted({json.dumps(layer["kwargs"]) for layer in self.records[-1]["layers"]})
            print(f"step {state.global_step}: checkpointing kwargs {', '.join(kwargs_now)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description="GKD + LoRA under DeepSpeed ZeRO-3 on CPU")
    parser.add_argument("--output-dir", default="gkd-zero3-output")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--checkpointing-log", metavar="DIR", help="write per-rank JSON of the checkpointing state")
    cli = parser.parse_args()

    tokenizer = build_tokenizer()
    conversation = [
        {"role": "user", "content": "hi how are you"},
        {"role": "assistant", "content": "i am fine thanks"},
    ]
    train_dataset = Dataset.from_dict({"messages": [conversation] * 16})

    training_args = GKDConfig(
        output_dir=cli.output_dir,
        deepspeed=DEEPSPEED_CONFIG,
        per_device_train_batch_size=2,
        max_steps=cli.max_steps,
        learning_rate=1e-3,
        lmbda=1.0,  # on-policy: the student generates at every step
        max_new_tokens=4,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=dict(CHECKPOINTING_KWARGS),
        bf16=False,  # fp32 on CPU
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    # After GKDConfig: transformers now knows ZeRO-3 is on and builds the models partitioned.
    model = build_model(tokenizer, seed=0)
    teacher_model = build_model(tokenizer, seed=1)

    trainer = GKDTrainer(
        model=model,
        teacher_model=teacher_model,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=train_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        callbacks=[CheckpointingLog(cli.checkpointing_log, CHECKPOINTING_KWARGS)] if cli.checkpointing_log else None,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"done: {trainer.state.global_step} optimizer steps", flush=True)
    if torch.distributed.is_initialized():
        # End the process group before the interpreter exits, so that no communication thread is still
        # running while the process tears down.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
