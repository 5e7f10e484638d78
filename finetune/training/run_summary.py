"""The end of a run: its figures (W&B's run summary) and the console table. A resumed run's figures say what the run
did (its steps, train_loss over all of them, as the uninterrupted run's) and what this process did (tokens, time)."""

from __future__ import annotations

import os

from finetune.evaluation import metrics
from finetune.recipe import LogConfig, TrainConfig
from finetune.training.reporting import wandb_mode, wandb_run_dir


def whole_run_loss(log_history: list[dict], global_step: int, start_step: int, this_process: float) -> float | None:
    """The run's train_loss over all its steps, as an uninterrupted run computes it (the sum of each logged interval's
    loss in order, over the steps), though this process trained only those after `start_step`; `this_process`: the
    Trainer's train_loss of its own steps."""
    logged, total, last = [e for e in log_history if "loss" in e and "grad_norm" in e], 0.0, 0
    for entry in logged:
        if entry["step"] > global_step:
            break
        total += entry["loss"] * (entry["step"] - last)
        last = entry["step"]
    if last == global_step:  # every step is in a logged interval
        return total / global_step if global_step else None
    before = sum(
        e["loss"] * (e["step"] - p)
        for e, p in zip(logged, [0] + [e["step"] for e in logged])
        if e["step"] <= start_step
    )
    return (before + this_process * (global_step - start_step)) / global_step if global_step else None


def record_whole_run_loss(trainer, start_step: int) -> None:
    """The log history's end-of-training entry (what trainer_state.json and W&B keep) gets the whole run's
    train_loss instead of this process's share."""
    end = next((e for e in reversed(trainer.state.log_history) if "train_loss" in e), None)
    if end is not None:
        end["train_loss"] = whole_run_loss(
            trainer.state.log_history, trainer.state.global_step, start_step, end["train_loss"]
        )


def summary(trainer, start_step: int = 0) -> dict:
    """The end-of-run figures: steps (of the run; `start_step`: where this process began), tokens, wall time and
    tokens/s of this process, final and whole-run train loss, peak memory."""
    steps = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    end = next((e for e in reversed(trainer.state.log_history) if "train_runtime" in e), {})
    runtime = end.get("train_runtime")
    totals = trainer.meter.run_totals
    return {
        "optimizer_steps": trainer.state.global_step,
        "start_step": start_step,
        "real_tokens": totals["real_tokens"],
        "label_tokens": totals["label_tokens"],
        "wall_time_s": runtime,
        "real_tokens_per_s": totals["real_tokens"] / runtime if runtime else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "train_loss": end.get("train_loss"),
        "peak_mem_mb": trainer.meter.peak_mem_mb or None,  # timing figures stay out of the log history
        **metrics.summary(trainer),
    }


def print_summary(train: TrainConfig, log: LogConfig, trainer, figures: dict) -> None:
    resumed = figures["start_step"]
    this = f" in this process (steps {resumed + 1}-{figures['optimizer_steps']})" if resumed else ""
    rows = [
        ("optimizer steps", f"{figures['optimizer_steps']}" + (f" (resumed after step {resumed})" if resumed else "")),
        ("real tokens", f"{figures['real_tokens']:,} ({figures['label_tokens']:,} targets){this}"),
        ("wall time", f"{figures['wall_time_s']:.1f} s{this}" if figures["wall_time_s"] else "n/a"),
        ("tokens/s", f"{figures['real_tokens_per_s']:.0f}" if figures["real_tokens_per_s"] else "n/a"),
        ("final loss", f"{figures['final_loss']:.4f}" if figures["final_loss"] is not None else "n/a"),
        (
            "train loss",
            f"{figures['train_loss']:.4f} (mean over all {figures['optimizer_steps']} steps)"
            if figures["train_loss"] is not None
            else "n/a",
        ),
        ("peak memory", f"{figures['peak_mem_mb']:.0f} MB" if figures["peak_mem_mb"] else "n/a"),
        *metrics.summary_rows(figures),
        ("model", f"{os.path.abspath(train.output_dir)}  (from_pretrained on this folder)"),
    ]
    run, mode = wandb_run_dir(train.output_dir), wandb_mode(log)
    if run:
        rows.append(("W&B run", f"{run}" + (f"  (upload later: wandb sync {run})" if mode == "offline" else "")))
    width = max(len(name) for name, _ in rows)
    print("\n".join(["done:"] + [f"  {name:<{width}}  {value}" for name, value in rows]), flush=True)
