"""Cross-field checks of a loaded recipe, in the user's key names, and what the global batch implies (accumulation)."""

from __future__ import annotations

from typing import Any

from finetune import env
from finetune.recipe.schema import CHOICES, Config, DataConfig, RecipeError, choice_error


def _get(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def is_budgeted(data: DataConfig) -> bool:
    """Micro-batches filled up to `data.max_tokens_per_micro_batch` rather than a fixed row count."""
    return data.batching == "token_budget" or (data.batching == "packed" and bool(data.max_tokens_per_micro_batch))


def evaluates(config: Config) -> bool:
    """The recipe has an eval set: a separate eval.source, or rows held out of data.source (eval.fraction)."""
    return bool(config.eval.source) or config.eval.fraction > 0


def accumulation_steps(config: Config, ranks: int) -> int:
    """Micro-batches per rank per optimizer step, from the global batch (sequences, or tokens when budgeted)."""
    train, data = config.train, config.data
    if is_budgeted(data):
        if not train.global_batch_tokens:
            raise RecipeError(
                f"data.batching={data.batching} with data.max_tokens_per_micro_batch fills micro-batches by tokens; "
                f"set train.global_batch_tokens (a multiple of {data.max_tokens_per_micro_batch} × {ranks} ranks)"
            )
        total, per_micro_step = train.global_batch_tokens, data.max_tokens_per_micro_batch * ranks
        names = f"train.global_batch_tokens={total} is not divisible by data.max_tokens_per_micro_batch="
        names += f"{data.max_tokens_per_micro_batch}"
    else:
        if train.global_batch_tokens:
            raise RecipeError(
                "train.global_batch_tokens applies to data.batching=token_budget (or packed with "
                "data.max_tokens_per_micro_batch); use train.global_batch_size for sequences"
            )
        if train.micro_batch_size == "auto":
            raise RecipeError("train.micro_batch_size=auto is chosen when training starts; run python -m finetune.plan "
                              "recipe=… to see the choice, or set a number")
        total, per_micro_step = train.global_batch_size, train.micro_batch_size * ranks
        names = f"train.global_batch_size={total} is not divisible by train.micro_batch_size={train.micro_batch_size}"
    if total % per_micro_step:
        lower = total // per_micro_step * per_micro_step
        options = " or ".join(str(v) for v in (lower, lower + per_micro_step) if v > 0)
        key = names.split("=", 1)[0]
        raise RecipeError(
            f"{names} × {ranks} rank{'s' if ranks != 1 else ''} = {per_micro_step}; "
            f"set {key} to a multiple of {per_micro_step} (e.g. {options})"
        )
    return total // per_micro_step


def check_optim_and_schedule(config: Config) -> None:
    """Optimizer and schedule keys that need no run length (warmup vs. run length: `schedules.check_schedule`)."""
    o, s = config.optim, config.schedule
    if o.lr_scaling != "none" and not o.base_batch_size:
        unit = "tokens, as train.global_batch_tokens" if config.train.global_batch_tokens else "sequences"
        raise RecipeError(
            f"optim.lr_scaling={o.lr_scaling} needs optim.base_batch_size (the global batch optim.lr was tuned for, in "
            f"{unit})"
        )
    ranges = [  # (key, value, holds, what it must be)
        ("optim.base_batch_size", o.base_batch_size, o.base_batch_size is None or o.base_batch_size > 0, "positive"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, "≥ 0"),
        ("optim.eps", o.eps, o.eps >= 0, "≥ 0"),
        ("optim.momentum", o.momentum, 0 <= o.momentum < 1, "in [0, 1)"),
        ("optim.betas", o.betas, len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "two numbers in [0, 1)"),
        ("optim.trust_coefficient", o.trust_coefficient, o.trust_coefficient > 0, "positive"),
        ("schedule.warmup_steps", s.warmup_steps, s.warmup_steps >= 0, "≥ 0"),
        ("schedule.warmup_ratio", s.warmup_ratio, 0 <= s.warmup_ratio < 1, "in [0, 1)"),
        ("schedule.warmup_factor", s.warmup_factor, 0 < s.warmup_factor <= 1, "in (0, 1]"),
        ("schedule.min_lr_ratio", s.min_lr_ratio, 0 <= s.min_lr_ratio <= 1, "in [0, 1]"),
        ("schedule.pct_start", s.pct_start, 0 < s.pct_start < 1, "in (0, 1)"),
        ("schedule.div_factor", s.div_factor, s.div_factor > 0, "positive"),
        ("schedule.final_div_factor", s.final_div_factor, s.final_div_factor > 0, "positive"),
    ]
    for key, value, holds, what in ranges:
        if not holds:
            raise RecipeError(f"{key}={value} must be {what}")
    if s.warmup_steps > 0 and s.warmup_ratio > 0:
        raise RecipeError("set schedule.warmup_steps or schedule.warmup_ratio, not both")
    if s.name == "onecycle" and (s.warmup_steps > 0 or s.warmup_ratio > 0):
        key = "schedule.warmup_steps" if s.warmup_steps > 0 else "schedule.warmup_ratio"
        raise RecipeError(
            f"{key} does not apply to schedule.name=onecycle, which warms up over schedule.pct_start of the run; "
            "remove it or set schedule.pct_start"
        )


def check_config(config: Config) -> None:
    for key, allowed in CHOICES.items():
        if _get(config, key) not in allowed:
            raise choice_error(key, _get(config, key))
    micro = config.train.micro_batch_size
    if isinstance(micro, str) and micro != "auto":
        raise RecipeError(f"train.micro_batch_size={micro!r} must be a positive integer or auto")
    positive = ["train.global_batch_size", "data.max_length", "log.every_steps"]
    positive += ["train.micro_batch_size"] if micro != "auto" else []
    for key in positive:
        if _get(config, key) < 1:
            raise RecipeError(f"{key}={_get(config, key)} must be at least 1")
    if config.optim.lr <= 0:
        raise RecipeError(f"optim.lr={config.optim.lr} must be positive")
    if config.train.max_steps < 1 and config.train.epochs <= 0:
        raise RecipeError("set train.max_steps to a positive number of optimizer steps or train.epochs above 0")
    profile = config.train.profile_steps
    if profile and (len(profile) != 2 or not 1 <= profile[0] <= profile[1]):
        raise RecipeError(
            f"train.profile_steps={list(profile)} must be [first, last] optimizer steps, 1 ≤ first ≤ last"
        )
    if config.log.peak_tflops is not None and config.log.peak_tflops <= 0:
        raise RecipeError(f"log.peak_tflops={config.log.peak_tflops} must be positive (the device's peak TFLOP/s)")
    if config.train.max_grad_norm < 0:
        raise RecipeError(f"train.max_grad_norm={config.train.max_grad_norm} must be ≥ 0 (0 turns clipping off)")
    if config.data.streaming and config.train.max_steps < 1:
        raise RecipeError("data.streaming=true has no dataset length to count epochs by; set train.max_steps")
    if config.data.streaming and (config.data.batching == "length_grouped" or is_budgeted(config.data)):
        raise RecipeError(
            f"data.batching={config.data.batching} sorts or budgets rows by length, which a stream does not know up "
            "front; use data.batching=padded or packed (without data.max_tokens_per_micro_batch), or "
            "data.streaming=false"
        )
    if config.data.batching == "token_budget" and not config.data.max_tokens_per_micro_batch:
        raise RecipeError("data.batching=token_budget needs data.max_tokens_per_micro_batch (tokens per micro-batch)")
    budget = config.data.max_tokens_per_micro_batch
    if budget and config.data.batching in ("padded", "length_grouped"):
        raise RecipeError(
            f"data.max_tokens_per_micro_batch applies to data.batching=token_budget or packed, not "
            f"{config.data.batching}; remove it or change data.batching"
        )
    if budget and budget < config.data.max_length:
        raise RecipeError(
            f"data.max_tokens_per_micro_batch={budget} is below data.max_length={config.data.max_length}: a "
            "longest row would not fit; raise the budget or lower data.max_length"
        )
    check_optim_and_schedule(config)
    check_eval(config)
    if config.train.precision == "fp16" and config.model.dtype != "float32":
        raise RecipeError(
            "train.precision=fp16 trains float32 weights under a GradScaler; set model.dtype=float32 "
            "(or use train.precision=bf16)"
        )
    ranks = env.world_size()
    if micro != "auto":
        accumulation_steps(config, ranks)
    elif is_budgeted(config.data):
        raise RecipeError(f"train.micro_batch_size=auto plans sequences per micro-batch; data.batching="
                          f"{config.data.batching} fills micro-batches by tokens: run python -m finetune.plan to "
                          "choose data.max_tokens_per_micro_batch")
    elif config.train.global_batch_size % ranks:
        raise RecipeError(f"train.global_batch_size={config.train.global_batch_size} is not divisible by the "
                          f"{ranks} ranks; set a multiple of {ranks}")


def check_eval(config: Config) -> None:
    """The eval section against itself and the data section."""
    ev, data = config.eval, config.data
    if ev.source and ev.fraction:
        raise RecipeError("set eval.source (a separate eval set) or eval.fraction (rows held out of data.source), not "
                          "both")
    if not 0 <= ev.fraction < 1:
        raise RecipeError(f"eval.fraction={ev.fraction} must be in [0, 1): the share of data.source held out")
    if not evaluates(config):
        asked = [key for key, given in (
            ("eval.every_steps", ev.every_steps), ("eval.best_checkpoint", ev.best_checkpoint),
            ("eval.early_stopping_patience", ev.early_stopping_patience), ("eval.limit", ev.limit is not None),
            ("eval.prompts", ev.prompts)) if given]
        if asked:
            raise RecipeError(f"{asked[0]} needs an eval set: set eval.fraction (e.g. 0.05: rows held out of "
                              "data.source) or eval.source")
        return
    if data.streaming and ev.fraction:
        raise RecipeError("eval.fraction holds rows out of data.source, which data.streaming=true reads only as "
                          "training goes; set eval.source to a separate eval set, or data.streaming=false")
    if ev.early_stopping_patience and not ev.every_steps:
        raise RecipeError("eval.early_stopping_patience counts evaluations during training; set eval.every_steps "
                          "(optimizer steps between evaluations)")
    budget = ev.max_tokens_per_micro_batch
    if ev.batching == "token_budget" and not budget:
        raise RecipeError("eval.batching=token_budget needs eval.max_tokens_per_micro_batch (tokens per eval "
                          "micro-batch)")
    if budget and ev.batching in ("padded", "length_grouped"):
        raise RecipeError(f"eval.max_tokens_per_micro_batch applies to eval.batching=token_budget or packed, not "
                          f"{ev.batching}; remove it or change eval.batching")
    if budget and budget < data.max_length:
        raise RecipeError(f"eval.max_tokens_per_micro_batch={budget} is below data.max_length={data.max_length}: a "
                          "longest row would not fit; raise the budget or lower data.max_length")
