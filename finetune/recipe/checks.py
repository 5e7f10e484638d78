"""Cross-field checks of a loaded recipe, in the user's key names, and what the global batch implies (accumulation)."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any

from finetune import env
from finetune.recipe.schema import CHOICES, Config, DataConfig, RecipeError, choice_error

COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


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
            raise RecipeError(
                "train.micro_batch_size=auto is chosen when training starts; run python -m finetune.plan "
                "recipe=… to see the choice, or set a number"
            )
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


def _number_text(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def bounds_text(bounds: dict) -> str:
    """What a key's bounds (schema.number) ask, in words: positive, ≥ 0, in [0, 1), …"""
    low, high = bounds["min"], bounds["max"]
    if low is not None and high is not None:
        return (
            f"in {'(' if bounds['min_exclusive'] else '['}{_number_text(low)}, {_number_text(high)}"
            f"{')' if bounds['max_exclusive'] else ']'}"
        )
    if low is not None:
        if low == 0:
            return "positive" if bounds["min_exclusive"] else "≥ 0"
        return f"{'>' if bounds['min_exclusive'] else '≥'} {_number_text(low)}"
    if high is not None:
        return f"{'<' if bounds['max_exclusive'] else '≤'} {_number_text(high)}"
    return "a finite number"


def out_of_bounds(value: Any, bounds: dict) -> bool:
    """A number outside its bounds, NaN or ±inf; other values (None, auto) are for the cross-field checks."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value):
        return True
    low, high = bounds["min"], bounds["max"]
    below = low is not None and (value < low or (bounds["min_exclusive"] and value == low))
    return below or (high is not None and (value > high or (bounds["max_exclusive"] and value == high)))


def _check_finite(value: Any, key: str) -> None:
    """Open maps (model.config_overrides, …): their keys belong to the model, so only finiteness is known here."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{key}={value} is not a finite number; fix the value")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, item in items:
        _check_finite(item, f"{key}.{name}" if isinstance(value, dict) else f"{key}[{name}]")


def check_numbers(section: Any, prefix: str = "") -> None:
    """Every numeric key against the bounds the schema declares for it (schema.number), each number of a list or map
    key included; and every number in the open maps finite. The messages are worded from the bounds."""
    for f in fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        if is_dataclass(value):
            check_numbers(value, key + ".")
            continue
        bounds = f.metadata.get("number")
        if bounds is None:
            if isinstance(value, (dict, list)):
                _check_finite(value, key)
            continue
        hint = f" ({bounds['hint']})" if bounds["hint"] else ""
        if isinstance(value, list):
            count = bounds["count"]
            if (count is not None and len(value) != count) or any(out_of_bounds(v, bounds) for v in value):
                many = f"{COUNT_WORDS.get(count, count)} numbers" if count else "numbers"
                raise RecipeError(f"{key}={list(value)} must be {many} {bounds_text(bounds)}{hint}")
            continue
        for name, number in value.items() if isinstance(value, dict) else [(None, value)]:
            if out_of_bounds(number, bounds):
                where = key if name is None else f"{key}.{name}"
                verb = "must be"
                if not math.isfinite(number):
                    verb = f"is not {'a number' if math.isnan(number) else 'finite'}; it must be"
                raise RecipeError(f"{where}={number} {verb} {bounds_text(bounds)}{hint}")


def check_optim_and_schedule(config: Config) -> None:
    """Optimizer and schedule keys that need no run length (warmup vs. run length: `schedules.check_schedule`)."""
    s = config.schedule
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
    o = config.optim
    if o.lr_scaling != "none" and not o.base_batch_size:
        unit = "tokens, as train.global_batch_tokens" if config.train.global_batch_tokens else "sequences"
        raise RecipeError(
            f"optim.lr_scaling={o.lr_scaling} needs optim.base_batch_size (the global batch optim.lr was tuned for, in "
            f"{unit})"
        )
    check_numbers(config)  # every key's own bounds (schema.number), before any key is combined with another
    if not config.train.output_dir.strip():
        raise RecipeError("train.output_dir is empty; set it to the folder the run writes to")
    if not config.model.name_or_path.strip():
        raise RecipeError("model.name_or_path is empty; set it to a model folder, a hub id, or pkg:PACKAGE")
    if not config.data.source.strip():
        raise RecipeError(
            "data.source is empty; set it to stdlib_docs, a jsonl/json/parquet/csv file or folder, or a hub dataset id"
        )
    if config.train.max_steps == 0:
        raise RecipeError(
            "train.max_steps=0 makes no optimizer step; set a positive number of steps, or -1 to train for train.epochs"
        )
    if micro == "auto" and config.data.streaming:
        raise RecipeError(
            "train.micro_batch_size=auto plans with the data's longest rows, which data.streaming=true "
            "does not know up front; set a number (python -m finetune.plan with data.streaming=false "
            "shows one)"
        )
    if config.train.max_steps < 1 and config.train.epochs <= 0:
        raise RecipeError("set train.max_steps to a positive number of optimizer steps or train.epochs above 0")
    profile = config.train.profile_steps
    if profile and (len(profile) != 2 or not 1 <= profile[0] <= profile[1]):
        raise RecipeError(
            f"train.profile_steps={list(profile)} must be [first, last] optimizer steps, 1 ≤ first ≤ last"
        )
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
        raise RecipeError(
            f"train.micro_batch_size=auto plans sequences per micro-batch; data.batching="
            f"{config.data.batching} fills micro-batches by tokens: run python -m finetune.plan to "
            "choose data.max_tokens_per_micro_batch"
        )
    elif config.train.global_batch_size % ranks:
        raise RecipeError(
            f"train.global_batch_size={config.train.global_batch_size} is not divisible by the "
            f"{ranks} ranks; set a multiple of {ranks}"
        )


def precision_on_device(config: Config, gpu_name: str | None, gpu_has_bf16: bool) -> str | None:
    """What the recipe's precision cannot do on this device (None: it can). `gpu_name`: the CUDA device, None on a CPU
    (accelerate runs fp16 there as plain fp32: no autocast, no GradScaler)."""
    if config.train.precision == "fp16" and gpu_name is None:
        return "train.precision=fp16 needs a GPU; on a CPU use train.precision=bf16 or fp32"
    wants_bf16 = [
        k
        for k, v in (
            ("train.precision", config.train.precision == "bf16"),
            ("model.dtype", config.model.dtype == "bfloat16"),
        )
        if v
    ]
    if gpu_name is not None and not gpu_has_bf16 and wants_bf16:
        return (
            f"{' and '.join(f'{k}={_get(config, k)}' for k in wants_bf16)} needs bf16, which this GPU ({gpu_name}) "
            "does not have (Ampere or newer does); use train.precision=fp16 with model.dtype=float32, or fp32"
        )
    return None


def precision_warning(config: Config) -> str | None:
    """model.dtype=bfloat16 with AdamW/LAMB/SGD/LARS: the optimizer updates bf16 weights in place (no float32 master
    copy), so an update below a weight's bf16 resolution (2^-8 of it) is rounded away. Allowed (half the memory), said
    once: an lr of 1e-5 on weights of 1e-2 is lost whole."""
    if config.model.dtype != "bfloat16":
        return None
    return (
        "model.dtype=bfloat16 trains bf16 weights without a float32 copy: updates smaller than 1/256 of a weight "
        "are rounded away; for exact small-lr updates use model.dtype=float32 with train.precision=bf16"
    )


def check_eval(config: Config) -> None:
    """The eval section against itself and the data section."""
    ev, data = config.eval, config.data
    if ev.source and ev.fraction:
        raise RecipeError(
            "set eval.source (a separate eval set) or eval.fraction (rows held out of data.source), not both"
        )
    if not evaluates(config):
        asked = [
            key
            for key, given in (
                ("eval.every_steps", ev.every_steps),
                ("eval.best_checkpoint", ev.best_checkpoint),
                ("eval.early_stopping_patience", ev.early_stopping_patience),
                ("eval.limit", ev.limit is not None),
                ("eval.prompts", ev.prompts),
            )
            if given
        ]
        if asked:
            raise RecipeError(
                f"{asked[0]} needs an eval set: set eval.fraction (e.g. 0.05: rows held out of "
                "data.source) or eval.source"
            )
        return
    if data.streaming and ev.fraction:
        raise RecipeError(
            "eval.fraction holds rows out of data.source, which data.streaming=true reads only as "
            "training goes; set eval.source to a separate eval set, or data.streaming=false"
        )
    if ev.early_stopping_patience and not ev.every_steps:
        raise RecipeError(
            "eval.early_stopping_patience counts evaluations during training; set eval.every_steps "
            "(optimizer steps between evaluations)"
        )
    budget = ev.max_tokens_per_micro_batch
    if ev.batching == "token_budget" and not budget:
        raise RecipeError(
            "eval.batching=token_budget needs eval.max_tokens_per_micro_batch (tokens per eval micro-batch)"
        )
    if budget and ev.batching in ("padded", "length_grouped"):
        raise RecipeError(
            f"eval.max_tokens_per_micro_batch applies to eval.batching=token_budget or packed, not "
            f"{ev.batching}; remove it or change eval.batching"
        )
    if budget and budget < data.max_length:
        raise RecipeError(
            f"eval.max_tokens_per_micro_batch={budget} is below data.max_length={data.max_length}: a "
            "longest row would not fit; raise the budget or lower data.max_length"
        )
