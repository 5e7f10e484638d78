"""Learning-rate schedules and LR scaling rules: pure functions of the optimizer step.

`total_steps` is always the number of optimizer steps of the run (never micro-batches); the Trainer steps the
scheduler once per optimizer step on every rank, and it is never passed through `accelerator.prepare` (which would
step it once per process).
"""

from __future__ import annotations

import math

import torch

from finetune.config import RecipeError, ScheduleConfig


def scaled_lr(lr: float, global_batch: int, rule: str, base_batch: int | None) -> float:
    """`optim.lr` after the scaling rule: × global/base (linear, Goyal et al. 2017) or × sqrt(global/base)."""
    if rule == "none":
        return lr
    ratio = global_batch / base_batch
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


def warmup_steps(total_steps: int, cfg: ScheduleConfig) -> int:
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def check_schedule(total_steps: int, cfg: ScheduleConfig) -> None:
    """Cross-checks that need the run's length; raised before any model is built."""
    if cfg.warmup_steps < 0 or not 0.0 <= cfg.warmup_ratio < 1.0:
        raise RecipeError("schedule.warmup_steps must be ≥ 0 and schedule.warmup_ratio in [0, 1)")
    if cfg.warmup_steps > 0 and cfg.warmup_ratio > 0:
        raise RecipeError("set schedule.warmup_steps or schedule.warmup_ratio, not both")
    warmup = warmup_steps(total_steps, cfg)
    if cfg.name != "onecycle" and warmup and warmup >= total_steps:
        raise RecipeError(
            f"schedule.warmup_steps={warmup} is not below the run's {total_steps} optimizer steps; lower it "
            "(or raise train.max_steps / train.epochs)"
        )
    if cfg.name == "onecycle":
        if not 0.0 < cfg.pct_start < 1.0:
            raise RecipeError(f"schedule.pct_start={cfg.pct_start} must be in (0, 1)")
        if cfg.div_factor <= 0 or cfg.final_div_factor <= 0:
            raise RecipeError("schedule.div_factor and schedule.final_div_factor must be positive")
        if total_steps < 2:
            raise RecipeError(f"schedule.name=onecycle needs at least 2 optimizer steps; the run has {total_steps}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise RecipeError(f"schedule.min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")


def warmup_factor(step: int, warmup: int, shape: str, constant_factor: float) -> float:
    """The LR factor at `step` < `warmup`: rising to 1 at `warmup` (linear, quadratic) or a held constant fraction.

    The ramp is (step + 1) / (warmup + 1), not step / warmup: no optimizer step is spent at LR 0.
    """
    if shape == "constant":
        return constant_factor
    progress = (step + 1) / (warmup + 1)
    return progress if shape == "linear" else progress**2


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of each param group's peak LR after `step` optimizer steps (warmup_cosine | linear | constant)."""
    warmup = warmup_steps(total_steps, cfg)
    if step < warmup:
        return warmup_factor(step, warmup, cfg.warmup, cfg.warmup_factor)
    if cfg.name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.name == "warmup_cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: ScheduleConfig):
    """The scheduler the Trainer steps once per optimizer step; each param group's LR is its peak."""
    if cfg.name == "onecycle":
        # torch's own OneCycleLR; momentum is left as the recipe sets it (optim.betas / optim.momentum).
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[group["lr"] for group in optimizer.param_groups], total_steps=total_steps,
            pct_start=cfg.pct_start, anneal_strategy=cfg.anneal, div_factor=cfg.div_factor,
            final_div_factor=cfg.final_div_factor, cycle_momentum=False,
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))


def describe_batch_and_lr(
    micro: int | str, accumulation: int, ranks: int, lr: float, scaled: float, rule: str, base: int | None,
    global_batch: int, unit: str = "sequences",
) -> str:
    """The start-up line, e.g. `effective batch 1024 sequences = micro 8 × accumulation 16 × 8 ranks; lr 1e-4 → …`."""
    line = (
        f"effective batch {global_batch} {unit} = micro {micro} × accumulation {accumulation} × {ranks} "
        f"rank{'s' if ranks != 1 else ''}; lr {lr:g}"
    )
    if rule != "none":
        line += f" → {scaled:g} ({rule} rule, base {base})"
    return line
