# transformers' Trainer with a PEFT LoRA model on CPU ranks, under DeepSpeed ZeRO-3 or plain DDP, with the
# checkpointing configuration chosen per case. Driven by tests/e2e/test_distributed.py, several cases one after
# the other in one process group (tests/e2e/ranks.py):
#
#     torchrun --nproc_per_node 2 tests/e2e/lora_trainer.py LOG_DIR "NAME: {zero3,ddp}
#         [--checkpointing {default,reentrant,non-reentrant,off}] [--modules-to-save lm_head] [--max-steps N]
#         [--shim-off PATCH]" ...
#
# Each rank writes LOG_DIR/NAME/lora-rank<R>.json: the loss of every optimizer step, the shim's patch states and
# effects, the find_unused_parameters and static_graph DDP was built with, and the library versions. "default"
# passes no checkpointing kwargs (transformers 5.x then checkpoints non-reentrantly).
import argparse
import copy
import os

from transformers import Trainer, TrainingArguments

import shim  # noqa: F401  (as for a user; a case's --shim-off switches patches off around it)
from tests.e2e.ranks import StepLog, TokenRows, run_cases, tiny_llama, with_lora

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


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora_trainer.py CASE")
    parser.add_argument("backend", choices=("zero3", "ddp"))
    parser.add_argument("--checkpointing", choices=(*CHECKPOINTING, "off"), default="default")
    parser.add_argument("--modules-to-save", nargs="*", default=None)
    parser.add_argument("--max-steps", type=int, default=2)
    return parser


def train(case: argparse.Namespace, directory: str) -> None:
    args = TrainingArguments(
        output_dir=os.path.join(directory, "output"),
        # A copy per case: the Trainer fills the "auto" values in.
        deepspeed=copy.deepcopy(DEEPSPEED_CONFIG) if case.backend == "zero3" else None,
        use_cpu=case.backend == "ddp",
        per_device_train_batch_size=2,
        max_steps=case.max_steps,
        learning_rate=1e-2,
        gradient_checkpointing=case.checkpointing != "off",
        gradient_checkpointing_kwargs=CHECKPOINTING.get(case.checkpointing),
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    # Built after the TrainingArguments: under ZeRO-3 the model is created partitioned.
    model = with_lora(tiny_llama(), modules_to_save=case.modules_to_save)
    log = StepLog(directory, "lora-rank")
    log.train(Trainer(model=model, args=args, train_dataset=TokenRows(32), callbacks=[log]))


if __name__ == "__main__":
    run_cases(options(), train)
