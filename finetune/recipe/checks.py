"""Cross-field checks of a loaded recipe, in the user's key names, and what the global batch implies (accumulation)."""

from __future__ import annotations

import importlib.util
from dataclasses import fields, is_dataclass
from typing import Any

from finetune import env
from finetune.recipe.batch_modes import Batching
from finetune.recipe.bounds import check_numbers
from finetune.recipe.fields import RecipeError
from finetune.recipe.schema import CHOICES, Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, choice_error
from finetune.recipe.set_checks import (
    check_batching,
    check_eval,
    check_mixture,
    global_batch_in_tokens,
    training_batching,
)


def _get(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def is_budgeted(data: DataConfig) -> bool:
    """Training micro-batches filled up to `data.max_tokens_per_micro_batch` rather than a fixed row count."""
    return Batching(data.batching, 1, data.max_tokens_per_micro_batch).budgeted


def accumulation_steps(config: Config, ranks: int) -> int:
    """Micro-batches per rank per optimizer step, from the global batch (sequences, or tokens when budgeted)."""
    train, data = config.train, config.data
    if is_budgeted(data):
        if not train.global_batch_tokens:
            per_step = data.max_tokens_per_micro_batch * ranks
            tokens = max(1, round(train.global_batch_size * data.max_length / per_step)) * per_step
            raise RecipeError(
                f"data.batching={data.batching} with data.max_tokens_per_micro_batch fills micro-batches by tokens; "
                f"set train.global_batch_tokens={tokens} (a multiple of {data.max_tokens_per_micro_batch} × {ranks} "
                f"rank{'s' if ranks != 1 else ''}, near train.global_batch_size rows of data.max_length)"
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
        key = names.split("=", 1)[0]
        options = " or ".join(f"{key}={v}" for v in (lower, lower + per_micro_step) if v > 0)
        raise RecipeError(
            f"{names} × {ranks} rank{'s' if ranks != 1 else ''} = {per_micro_step}; "
            f"set {options} (a multiple of {per_micro_step})"
        )
    return total // per_micro_step


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


BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw")  # optim.name choices that bitsandbytes provides


def check_quantization(model: ModelConfig, optim: OptimConfig) -> None:
    """model.quantization and the bitsandbytes optimizers against each other and the installed packages."""
    bits = model.quantization.bits
    if bits != "none" and not model.lora.enabled:
        raise RecipeError(
            f"model.quantization.bits={bits}: the quantized base weights cannot train; set model.lora.enabled=true "
            "(QLoRA: adapters over the quantized base) or model.quantization.bits=none"
        )
    if bits != "none" and model.lora.merge:
        raise RecipeError(
            f"model.lora.merge=true with model.quantization.bits={bits}: the merge would add the adapter to rounded "
            "base weights, not the full-precision base; set model.lora.merge=false (the adapter is saved) and merge "
            "it into the full-precision base with peft"
        )
    needs = "model.quantization.bits=" + bits if bits != "none" else None
    if optim.name in BNB_OPTIMIZERS:
        needs = f"optim.name={optim.name}"
    if needs and importlib.util.find_spec("bitsandbytes") is None:
        raise RecipeError(f"{needs} needs bitsandbytes, which is not installed; pip install bitsandbytes")


def check_config(config: Config) -> None:
    """Every cross-field rule of a loaded recipe; the first broken one is a RecipeError in the user's key names."""
    check_choices(config)
    check_lr_scaling(config)
    check_numbers(config)  # every key's own bounds (schema.number), before any key is combined with another
    check_mappings(config)
    check_named(config)
    check_run_length(config)
    data = config.data
    check_batching(training_batching(config), data.max_length, data.streaming, global_batch_in_tokens(config))
    check_mixture(config.data)
    check_optim_and_schedule(config)
    check_quantization(config.model, config.optim)
    check_eval(config)
    if config.train.precision == "fp16" and config.model.dtype != "float32":
        raise RecipeError(
            "train.precision=fp16 trains float32 weights under a GradScaler; set model.dtype=float32 "
            "(or use train.precision=bf16)"
        )
    check_global_batch(config, env.world_size())


def check_choices(config: Config) -> None:
    for key, allowed in CHOICES.items():
        if _get(config, key) not in allowed:
            raise choice_error(key, _get(config, key))
    micro = config.train.micro_batch_size
    if isinstance(micro, str) and micro != "auto":
        raise RecipeError(f"train.micro_batch_size={micro!r} must be a positive integer or auto")


def check_mappings(section: Any, prefix: str = "") -> None:
    """Every map key of the schema (schema.mapping): its keys and values are names, each one of those it allows."""
    for f in fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        if is_dataclass(value):
            check_mappings(value, key + ".")
        if "mapping" not in f.metadata:
            continue
        if not isinstance(value, dict):
            raise RecipeError(f"{key}={value!r} is not a map; write e.g. {key}={{name: other}}")
        allowed = f.metadata["mapping"]
        for name, target in value.items():
            if not str(name).strip() or not isinstance(target, str) or not target.strip():
                raise RecipeError(f"{key}.{name}={target!r}: both sides must be names (non-empty text)")
            for part, choices in ((name, allowed["keys"]), (target, allowed["values"])):
                if choices and part not in choices:
                    raise RecipeError(f"{key}.{name}={target}: {part!r} is not one of {', '.join(choices)}")


def check_lr_scaling(config: Config) -> None:
    """LR scaling names the batch its lr was tuned for (said before that batch's own bounds: 0 means unset)."""
    o = config.optim
    if o.lr_scaling != "none" and not o.base_batch_size:
        tokens = config.train.global_batch_tokens
        unit = "tokens, as train.global_batch_tokens" if tokens else "sequences"
        raise RecipeError(
            f"optim.lr_scaling={o.lr_scaling} needs optim.base_batch_size (the global batch optim.lr was tuned for, in "
            f"{unit}); set optim.base_batch_size={tokens or config.train.global_batch_size} where optim.lr was tuned "
            "at this run's global batch"
        )


def check_named(config: Config) -> None:
    """Keys that name something are not empty."""
    if not config.train.output_dir.strip():
        raise RecipeError("train.output_dir is empty; set it to the folder the run writes to")
    if not config.model.name_or_path.strip():
        raise RecipeError("model.name_or_path is empty; set it to a model folder, a hub id, or pkg:PACKAGE")
    if not config.data.source.strip() and not config.data.mixture:
        raise RecipeError(
            "data.source is empty; set it to stdlib_docs, a jsonl/json/parquet/csv file or folder, or a hub dataset id"
        )


def check_run_length(config: Config) -> None:
    train = config.train
    if train.max_steps == 0:
        raise RecipeError(
            "train.max_steps=0 makes no optimizer step; set a positive number of steps, or -1 to train for train.epochs"
        )
    if train.micro_batch_size == "auto" and config.data.streaming:
        raise RecipeError(
            "train.micro_batch_size=auto plans with the data's longest rows, which data.streaming=true "
            "does not know up front; set a number (python -m finetune.plan with data.streaming=false "
            "shows one)"
        )
    if train.max_steps < 1 and train.epochs <= 0:
        raise RecipeError("set train.max_steps to a positive number of optimizer steps or train.epochs above 0")
    profile = train.profile_steps
    if profile and (len(profile) != 2 or not 1 <= profile[0] <= profile[1]):
        raise RecipeError(
            f"train.profile_steps={list(profile)} must be [first, last] optimizer steps, 1 ≤ first ≤ last"
        )
    if config.data.streaming and train.max_steps < 1:
        raise RecipeError("data.streaming=true has no dataset length to count epochs by; set train.max_steps")


def check_global_batch(config: Config, ranks: int) -> None:
    """The global batch splits into micro-batches × accumulation × ranks (auto: planned at start, in sequences)."""
    if config.train.micro_batch_size != "auto":
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


def precision_on_device(train: TrainConfig, model: ModelConfig, gpu_name: str | None, gpu_has_bf16: bool) -> str | None:
    """What the recipe's precision cannot do on this device (None: it can). `gpu_name`: the CUDA device, None on a CPU
    (accelerate runs fp16 there as plain fp32: no autocast, no GradScaler)."""
    if train.precision == "fp16" and gpu_name is None:
        return "train.precision=fp16 needs a GPU; on a CPU use train.precision=bf16 or train.precision=fp32"
    wants_bf16 = [
        f"{k}={v}"
        for k, v, wanted in (
            ("train.precision", train.precision, "bf16"),
            ("model.dtype", model.dtype, "bfloat16"),
        )
        if v == wanted
    ]
    if gpu_name is not None and not gpu_has_bf16 and wants_bf16:
        fp32 = "train.precision=fp32" + (" with model.dtype=float32" if model.dtype == "bfloat16" else "")
        return (
            f"{' and '.join(wants_bf16)} needs bf16, which this GPU ({gpu_name}) "
            f"does not have (Ampere or newer does); use train.precision=fp16 with model.dtype=float32, or {fp32}"
        )
    return None


def precision_warning(model: ModelConfig) -> str | None:
    """model.dtype=bfloat16 with AdamW/LAMB/SGD/LARS: the optimizer updates bf16 weights in place (no float32 master
    copy), so an update below a weight's bf16 resolution (2^-8 of it) is rounded away. Allowed (half the memory), said
    once: an lr of 1e-5 on weights of 1e-2 is lost whole."""
    if model.dtype != "bfloat16":
        return None
    return (
        "model.dtype=bfloat16 trains bf16 weights without a float32 copy: updates smaller than 1/256 of a weight "
        "are rounded away; for exact small-lr updates use model.dtype=float32 with train.precision=bf16"
    )


def levers_on_device(model: ModelConfig, gpu_name: str | None) -> str | None:
    """What the recipe's speed levers cannot do on this machine (None: they can); said before the model loads."""
    if not model.liger_kernels:
        return None
    if gpu_name is None:
        return (
            "model.liger_kernels=true needs a CUDA GPU (Liger's kernels are triton GPU kernels); set it false on this "
            "machine"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        return "model.liger_kernels=true needs liger-kernel, which is not installed: pip install liger-kernel"
    return None
