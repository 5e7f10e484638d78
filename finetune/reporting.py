"""What a run shows: W&B set-up, start-up lines, a step-count check and the end-of-run summary."""

from __future__ import annotations

import glob
import os

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from finetune.config import Config, RecipeError


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main_print(line: str) -> None:
    if is_main_process():
        print(line, flush=True)


def has_accelerator() -> bool:
    return torch.cuda.is_available()


def run_name(cfg: Config) -> str:
    if cfg.log.run_name:
        return cfg.log.run_name
    recipe = os.path.splitext(os.path.basename(cfg.recipe))[0] if cfg.recipe else "run"
    return f"{recipe}-gb{cfg.train.global_batch_size}-lr{cfg.optim.lr:g}"


def configure_wandb(cfg: Config) -> None:
    """W&B runs land under the output directory; offline runs need no key and upload later with `wandb sync`."""
    if cfg.log.wandb_mode == "disabled":
        os.environ["WANDB_MODE"] = "disabled"
        return
    os.environ["WANDB_MODE"] = cfg.log.wandb_mode
    os.environ["WANDB_PROJECT"] = cfg.log.wandb_project
    os.environ.setdefault("WANDB_DIR", os.path.abspath(cfg.train.output_dir))
    os.environ.setdefault("WANDB_SILENT", "true")


def wandb_run_dir(cfg: Config) -> str | None:
    runs = sorted(glob.glob(os.path.join(os.environ.get("WANDB_DIR", cfg.train.output_dir), "wandb", "*run-*")))
    return runs[-1] if runs else None


def resume_path(cfg: Config) -> str | None:
    resume = cfg.train.resume_from
    if resume is None:
        return None
    if resume == "auto":
        if not os.path.isdir(cfg.train.output_dir):
            return None
        return get_last_checkpoint(cfg.train.output_dir)  # newest checkpoint-N, or None: start fresh
    if not os.path.isdir(resume):
        raise RecipeError(f"train.resume_from={resume}: no such checkpoint directory; give a checkpoint-N folder or auto")
    return resume


class StepCountCheck(TrainerCallback):
    """The schedule was built for `total_steps`; the Trainer must run exactly that many optimizer steps."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps != self.total_steps:
            raise RuntimeError(
                f"the schedule was built for {self.total_steps} optimizer steps but the Trainer plans {state.max_steps}"
            )


def print_summary(cfg: Config, trainer) -> None:
    history = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    final = f"{history[-1]['loss']:.4f}" if history else "n/a"
    lines = [
        f"done: {trainer.state.global_step} optimizer steps, final loss {final}",
        f"model: {os.path.abspath(cfg.train.output_dir)}  (AutoModelForCausalLM.from_pretrained on this folder)",
    ]
    run = wandb_run_dir(cfg)
    if run and cfg.log.wandb_mode == "offline":
        lines.append(f"W&B offline run: {run}  (upload later: wandb sync {run})")
    elif run:
        lines.append(f"W&B run: {run}")
    print("\n".join(lines), flush=True)
