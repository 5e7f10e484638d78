"""Learning-rate schedules and LR scaling rules: pure functions of the optimizer step.

`total_steps` is always the number of optimizer steps of the run (never micro-batches); the Trainer steps the
scheduler once per optimizer step on every rank, and it is never passed through `accelerator.prepare` (which would
step it once per process). Checks that need no run length live in `finetune.recipe.checks.check_config`.
"""

from __future__ import annotations

import math

import torch

from finetune.recipe import DataConfig, OptimConfig, RecipeError, ScheduleConfig, TrainConfig, choice_error
from finetune.recipe.run_plan import RunPlan


def recipe_warmup_steps(total_steps: int, cfg: ScheduleConfig) -> int:
    """The warmup the recipe asks for, in optimizer steps: schedule.warmup_steps, or ⌈warmup_ratio × total⌉."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def warmup_steps(total_steps: int, cfg: ScheduleConfig) -> int:
    """The warmup used: the recipe's, at most total_steps - 1 (a run as short as its warmup, e.g. a 2-step smoke test
    of a recipe that warms up over 2, still reaches the peak at its last step; a 1-step run has none)."""
    return min(recipe_warmup_steps(total_steps, cfg), max(total_steps - 1, 0))


def check_schedule(total_steps: int, cfg: ScheduleConfig) -> str | None:
    """Cross-checks that need the run's length (known once the data is batched), raised before training starts; the
    one note to print (None: nothing to say) when the warmup is shortened to fit the run."""
    if total_steps < 1:
        raise RecipeError(f"the run has {total_steps} optimizer steps; raise train.max_steps or train.epochs")
    if cfg.name == "onecycle":  # torch's OneCycleLR, warming up over pct_start of the run, however short
        if total_steps == 1:
            return (
                "note: schedule.name=onecycle over 1 optimizer step: the step runs at the cycle's final lr (peak / "
                "schedule.div_factor / schedule.final_div_factor)"
            )
        return None
    asked, used = recipe_warmup_steps(total_steps, cfg), warmup_steps(total_steps, cfg)
    if asked == used:
        return None
    key = (
        f"schedule.warmup_steps={cfg.warmup_steps}"
        if cfg.warmup_steps > 0
        else f"schedule.warmup_ratio={cfg.warmup_ratio} ({asked} step{'s' if asked != 1 else ''})"
    )
    steps = f"{total_steps} optimizer step{'s' if total_steps != 1 else ''}"
    instead = f"warming up over {used} step{'s' if used != 1 else ''}" if used else "no warmup"
    return f"note: {key} is not below the run's {steps}; {instead} instead (the last step at the peak lr)"


def warmup_factor(step: int, warmup: int, shape: str, constant_factor: float) -> float:
    """The LR factor at `step` < `warmup`: rising to 1 at `warmup` (linear, quadratic) or a held constant fraction.

    The ramp is (step + 1) / (warmup + 1), not step / warmup: no optimizer step is spent at LR 0.
    """
    if shape == "constant":
        return constant_factor
    progress = (step + 1) / (warmup + 1)
    return progress if shape == "linear" else progress**2


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of each param group's peak LR for 0-based optimizer step `step` (warmup_cosine | linear | constant).

    After warmup: constant holds 1; linear and warmup_cosine decay from 1 at the end of warmup towards
    schedule.min_lr_ratio, which they reach at step `total_steps` (one past the last step, as in transformers).
    """
    warmup = warmup_steps(total_steps, cfg)
    if step < warmup:
        return warmup_factor(step, warmup, cfg.warmup, cfg.warmup_factor)
    if cfg.name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.name == "warmup_cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def onecycle_pct_start(pct_start: float, total_steps: int) -> float:
    """pct_start as torch's OneCycleLR gets it. Where pct_start × total_steps is exactly 1 (0.1 of 10 steps, 0.5 of 2)
    its warm-up phase starts and ends at step 0 and torch divides by zero; the next float above keeps the one warm-up
    step that pct_start asks for (step 0 at peak / div_factor, the peak's anneal from step 1)."""
    while float(pct_start * total_steps) - 1 == 0:
        pct_start = math.nextafter(pct_start, 1.0)
    return pct_start


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: ScheduleConfig):
    """The scheduler the Trainer steps once per optimizer step; each param group's LR is its peak."""
    if cfg.name == "onecycle":
        # torch's own OneCycleLR. cycle_momentum=False: the recipe's optim.betas / optim.momentum are kept as set.
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=[group["lr"] for group in optimizer.param_groups],
            total_steps=total_steps,
            pct_start=onecycle_pct_start(cfg.pct_start, total_steps),
            anneal_strategy=cfg.anneal,
            div_factor=cfg.div_factor,
            final_div_factor=cfg.final_div_factor,
            cycle_momentum=False,
        )
    if cfg.name in ("warmup_cosine", "linear", "constant"):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
    raise choice_error("schedule.name", cfg.name)


def lr_per_step(total_steps: int, cfg: ScheduleConfig, peak_lr: float) -> list[float]:
    """The LR each optimizer step uses (as the Trainer logs it), from the real scheduler on a one-number optimizer."""
    check_schedule(total_steps, cfg)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr)
    scheduler = build_scheduler(optimizer, total_steps, cfg)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def format_lr(lr: float) -> str:
    """1e-4 rather than 0.0001, 2.83e-4 rather than 0.000282843: the way LRs are written in recipes and papers."""
    if lr == 0 or 1e-2 <= abs(lr) < 1e4:
        return f"{lr:.4g}"
    mantissa, exponent = f"{lr:.3e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def describe_batch_and_lr(
    micro: int | str,
    accumulation: int,
    ranks: int,
    lr: float,
    scaled: float,
    rule: str,
    base: int | None,
    global_batch: int,
    unit: str = "sequences",
) -> str:
    """The start-up line, e.g.
    `effective batch 1024 sequences = micro 8 × accumulation 16 × 8 ranks; lr 1e-4 → 4e-4 (linear rule, base 256)`.
    """
    line = (
        f"effective batch {global_batch} {unit} = micro {micro} × accumulation {accumulation} × {ranks} "
        f"rank{'s' if ranks != 1 else ''}; lr {format_lr(lr)}"
    )
    if rule != "none":
        base_text = f"{base}" if unit == "sequences" else f"{base} {unit}"
        line += f" → {format_lr(scaled)} ({rule} rule, base {base_text})"
    return line


def startup_line(train: TrainConfig, data: DataConfig, optim: OptimConfig, plan: RunPlan, total_steps: int) -> str:
    """`describe_batch_and_lr` for a planned run, with its optimizer steps."""
    micro = f"{data.max_tokens_per_micro_batch} tokens" if plan.batch_unit == "tokens" else train.micro_batch_size
    line = describe_batch_and_lr(
        micro,
        plan.accumulation,
        plan.ranks,
        optim.lr,
        plan.peak_lr,
        optim.lr_scaling,
        optim.base_batch_size,
        plan.global_batch,
        plan.batch_unit,
    )
    return f"{line}; {total_steps} optimizer step{'s' if total_steps != 1 else ''}"
