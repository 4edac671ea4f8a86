# One-rank, no-DeepSpeed training runs of real trl trainers (GRPO, DPO) with gradient checkpointing configured,
# recording what the model's checkpointing modules hold after every optimizer step. Driven by tests/e2e/test_e2e.py,
# several cases one after the other in one process (tests/e2e/ranks.py):
#
#     python tests/e2e/single_rank.py LOG_DIR "NAME: {grpo,dpo} [--max-steps N] [--shim-off all]" ...
#
# The tiny tokenizer, model and the recording callback are the example's (examples/gkd_zero3.py); each case
# writes LOG_DIR/NAME/checkpointing-rank0.json.
import argparse
import inspect
import os
import sys

import torch
from datasets import Dataset
from transformers import PreTrainedModel

import shim  # noqa: F401  -- as for a user (a case's --shim-off all switches every patch off around it)
from tests.e2e.ranks import run_cases

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from gkd_zero3 import CheckpointingLog, build_tokenizer  # noqa: E402
from gkd_zero3 import build_model as build_tiny_llama  # noqa: E402

NUM_LAYERS = 4


def supports_every_n_layers() -> bool:
    """transformers 5.16+ takes ``every_n_layers`` (in ``activation_checkpointing_enable`` from 5.23)."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        method = getattr(PreTrainedModel, name, None)
        if method is not None and "every_n_layers" in inspect.signature(method).parameters:
            return True
    return False


def configured_kwargs() -> dict:
    kwargs = {"use_reentrant": True}
    if supports_every_n_layers():
        kwargs["every_n_layers"] = 2
    return kwargs


def build_model(tokenizer):
    return build_tiny_llama(tokenizer, seed=0, num_hidden_layers=NUM_LAYERS)


def common_args(log_dir: str, max_steps: int, configured: dict) -> dict:
    return dict(
        output_dir=os.path.join(log_dir, "output"),
        per_device_train_batch_size=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=dict(configured),
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


class TorchChunkedLogProb:
    """CPU stand-in for trl's Triton ``ChunkedLogProbFunction`` (trl 1.15 computes GRPO/DPO log-probs with it
    and has no fallback; Triton does not run on CPU). Same outputs from the full logits, with autograd: it acts
    on the LM head after the decoder stack and has nothing to do with checkpointing."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        z = torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        log_probs_all = torch.log_softmax(z, dim=-1)
        log_probs = log_probs_all.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(log_probs_all.exp() * log_probs_all).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            log_sum_sq = torch.logsumexp(2 * log_probs_all, -1) if "log_sum_sq_probs" in outputs else None
            mean_logits = z.mean(-1) if "mean_logits" in outputs else None
            is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1


def use_cpu_lm_head_kernel():
    import trl.trainer.utils

    if getattr(trl.trainer.utils, "_ChunkedLogProbFunction", True) is None:
        trl.trainer.utils._ChunkedLogProbFunction = TorchChunkedLogProb


def reward_length(completions, **kwargs):
    """Tiny reward: longer completions score higher."""
    return [float(len(str(completion).split())) for completion in completions]


def make_grpo(tokenizer, model, args, callback):
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": ["hi how are you", "what is your name", "the cat sat on", "my dog"] * 4})
    config = GRPOConfig(**args, num_generations=2, max_completion_length=4)
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_length,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )


def make_dpo(tokenizer, model, args, callback):
    # An explicit reference model: the policy is built in code and has no path to load one from.
    from trl import DPOConfig, DPOTrainer

    dataset = Dataset.from_dict(
        {
            "prompt": ["hi how are you", "what is your name"] * 8,
            "chosen": [" i am fine thanks", " my name is cat"] * 8,
            "rejected": [" the dog", " a mat"] * 8,
        }
    )
    config = DPOConfig(**args, max_length=32)
    return DPOTrainer(
        model=model,
        ref_model=build_model(tokenizer),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="single_rank.py CASE")
    parser.add_argument("trainer", choices=("grpo", "dpo"))
    parser.add_argument("--max-steps", type=int, default=2)
    return parser


def train(case: argparse.Namespace, directory: str) -> None:
    configured = configured_kwargs()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    callback = CheckpointingLog(directory, configured)
    make = {"grpo": make_grpo, "dpo": make_dpo}[case.trainer]
    trainer = make(tokenizer, model, common_args(directory, case.max_steps, configured), callback)
    trainer.train()
    print(f"done: {trainer.state.global_step} optimizer steps", flush=True)


if __name__ == "__main__":
    use_cpu_lm_head_kernel()
    run_cases(options(), train)
