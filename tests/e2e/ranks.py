"""What the rank scripts of tests/e2e share, imported by them inside the training processes: the tiny
Llama and its LoRA, the rows of token ids they train on, the per-case record of a rank, and running
the cases of one launch in sequence.

A launch is ``SCRIPT LOG_DIR CASE [CASE ...]`` (under torchrun for two ranks). Each CASE is
``"NAME: OPTIONS"``: OPTIONS are the script's own command line for one training run, plus
``--shim-off PATCH[,PATCH]`` (``all``: every patch), switched off with ``shim.disabled`` around the
case. The cases run one after the other in the same processes (one process group, one import of the
stack); case NAME writes into LOG_DIR/NAME/: the script's records and ``case-rank<R>.json``, whether
the rank got past it. tests/e2e/launch.py reads them and cuts the logs at the lines ``CASE_MARK``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainerCallback

import shim

VOCAB = 64
LENGTH = 12
HIDDEN = 32
CASE_MARK = "----- e2e case: "
VERSIONS = ("torch", "transformers", "peft", "accelerate", "deepspeed")


def tiny_llama(seed: int = 0, **config):
    """A tiny Llama, built with ``from_config``: under ZeRO-3 (after the TrainingArguments exist) it is
    created partitioned, as ``from_pretrained`` would."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        **config,
    )
    return AutoModelForCausalLM.from_config(config)


def with_lora(model, **config):
    """``model`` as a PEFT LoRA model on ``q_proj`` and ``v_proj``, its adapters the same in every case."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    settings = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, LoraConfig(**{**settings, **config}))


class TokenRows(torch.utils.data.Dataset):
    """``count`` rows of random token ids, each its own label; the same rows in every run."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _effect_counts() -> dict[str, int]:
    return {patch.name: patch.effects for patch in shim.status()}


def _version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


class Report:
    """One rank's JSON record of one case, ``DIRECTORY/<records><rank>.json``: the script's fields, the
    shim's patch states, what each patch changed in this case (the process runs several: its counts
    since the case began) and the library versions."""

    def __init__(self, directory: str, records: str) -> None:
        self.path = os.path.join(directory, f"{records}{rank()}.json")
        self.effects_before = _effect_counts()

    def write(self, **fields) -> None:
        since = {name: count - self.effects_before.get(name, 0) for name, count in _effect_counts().items()}
        record = {
            **fields,
            # Inside switched_off()'s shim.disabled() a patch keeps its state and its layers are off.
            "shim": {patch.name: "suspended" if patch.suspended else patch.state for patch in shim.status()},
            "effects": {name: count for name, count in since.items() if count},
            "versions": {name: _version(name) for name in VERSIONS},
        }
        with open(self.path, "w") as handle:
            json.dump(record, handle, indent=1)


class StepLog(TrainerCallback):
    """Records a Trainer's case: the loss of every optimizer step, the ``find_unused_parameters`` and
    ``static_graph`` DDP was built with, and the error (first line) if training raised."""

    def __init__(self, directory: str, records: str) -> None:
        self.report = Report(directory, records)
        self.trainer = None
        self.losses: list[float] = []
        self.error: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.write()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.write()

    def write(self) -> None:
        wrapped = getattr(self.trainer, "model_wrapped", None)
        self.report.write(
            losses=self.losses,
            error=self.error,
            find_unused_parameters=getattr(wrapped, "find_unused_parameters", None),
            static_graph=getattr(wrapped, "static_graph", None),
        )

    def train(self, trainer) -> None:
        """``trainer.train()``, recorded; the first rank then says ``done: N optimizer steps``."""
        self.trainer = trainer
        try:
            trainer.train()
        except Exception as error:
            self.error = traceback.format_exception_only(error)[-1].strip()[:300]
            self.write()
            raise
        self.write()
        if trainer.is_world_process_zero():
            print(f"done: {trainer.state.global_step} optimizer steps", flush=True)


def switched_off(patches: str):
    """``shim.disabled`` for ``--shim-off``: ``""`` none, ``all`` every patch, else the names (commas)."""
    if not patches:
        return contextlib.nullcontext()
    return shim.disabled(*(() if patches == "all" else patches.split(",")))


def _write_status(directory: str, finished: bool, error: str | None = None) -> None:
    with open(os.path.join(directory, f"case-rank{rank()}.json"), "w") as handle:
        json.dump({"finished": finished, "error": error}, handle)


def run_cases(options: argparse.ArgumentParser, train: Callable[[argparse.Namespace, str], None]) -> None:
    """Run the launch's cases (``sys.argv``: LOG_DIR CASE...) in order: ``train(case options, directory)``
    for each, with its ``--shim-off`` patches switched off around it.

    On several ranks a case that raises ends the launch (the exception propagates, as in a run of its
    own): what DDP's reducer, a DeepSpeed engine or the process group hold after an error in a forward
    or backward is no state for a further case to start from, so the tests put such a case last. A lone
    process (no process group) prints the error and goes on with the next case."""
    options.add_argument("--shim-off", metavar="PATCH", default="", help="patches to switch off (all: every one)")
    launch = argparse.ArgumentParser(description="run several cases in sequence")
    launch.add_argument("log_dir")
    launch.add_argument("cases", nargs="+", metavar="CASE", help='"NAME: OPTIONS"')
    cli = launch.parse_args()
    several_ranks = int(os.environ.get("WORLD_SIZE", "1")) > 1
    for case in cli.cases:
        name, _, arguments = case.partition(":")
        name = name.strip()
        directory = os.path.join(cli.log_dir, name)
        os.makedirs(directory, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            print(f"{CASE_MARK}{name}", file=stream, flush=True)
        _write_status(directory, finished=False)
        parsed = options.parse_args(shlex.split(arguments))
        try:
            with switched_off(parsed.shim_off):
                train(parsed, directory)
        except Exception as error:
            _write_status(directory, finished=False, error=traceback.format_exception_only(error)[-1].strip()[:300])
            if several_ranks:
                raise
            traceback.print_exc()
        else:
            _write_status(directory, finished=True)
        gc.collect()  # the case's trainer, engine and model go before the next case builds its own
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank starts the next case together
    if torch.distributed.is_initialized():
        # End the process group before the interpreter exits, so that no communication thread is still
        # running while the process tears down.
        torch.distributed.destroy_process_group()
