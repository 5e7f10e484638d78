"""What `accelerate launch` decided, checked against the recipe before anything heavy is loaded.

`accelerate launch` passes its config to each rank as environment variables (accelerate/utils/launch.py:
ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE, ACCELERATE_GRADIENT_*,
ACCELERATE_USE_FSDP, FSDP_*; torchrun adds WORLD_SIZE). The Trainer then mixes them with TrainingArguments: a
mixed precision the recipe did not ask for is used silently, and a DeepSpeed value that is not "auto" is compared
only after the model is loaded, in DeepSpeed's names. `check_launch` says it at once, in the recipe's key names.

The recipe is the one source of truth: precision, micro-batch, accumulation, clipping, optimizer and schedule. The
shipped accelerate_configs/ leave all of them out, so DeepSpeed's batch keys stay "auto" and transformers fills
them from TrainingArguments (HfTrainerDeepSpeedConfig.trainer_config_process).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from finetune.recipe import DataConfig, OptimConfig, RecipeError, RunPlan, TrainConfig, is_budgeted

# accelerate's names for the precisions a recipe can ask for (train.precision)
RECIPE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def uses_deepspeed(env: Mapping[str, str] = os.environ) -> bool:
    return _true(env.get("ACCELERATE_USE_DEEPSPEED"))


def uses_fsdp(env: Mapping[str, str] = os.environ) -> bool:
    return _true(env.get("ACCELERATE_USE_FSDP"))


def _precision_problem(precision: str, env: Mapping[str, str]) -> str | None:
    """`precision`: train.precision."""
    launched = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    wanted = RECIPE_PRECISION[precision]
    # "no" is accelerate's default and cannot be told apart from an unset value: the recipe decides then.
    if launched in ("no", wanted):
        return None
    recipe_value = {"no": None, "bf16": "bf16", "fp16": "fp16"}.get(launched)
    fix_recipe = f"pass train.precision={recipe_value}, or " if recipe_value else ""
    return (
        f"accelerate launch runs with mixed_precision={launched} but the recipe has "
        f"train.precision={precision}; {fix_recipe}remove mixed_precision from the accelerate config "
        "(and --mixed_precision from the command line) so the recipe decides"
    )


def _recipe_batch(train: TrainConfig, data: DataConfig, plan: RunPlan) -> dict[str, tuple[float, str]]:
    """DeepSpeed key -> (the value the recipe implies, how the recipe says it)."""
    clipping = {"gradient_clipping": (train.max_grad_norm, f"train.max_grad_norm={train.max_grad_norm}")}
    accumulation, ranks = plan.accumulation, plan.ranks
    if accumulation is None:  # train.micro_batch_size=auto: the batch keys are compared once it is planned
        return clipping
    plural = "s" if ranks != 1 else ""
    if is_budgeted(data):
        micro, micro_text = 1, f"1 (data.batching={data.batching} fills each micro-batch by tokens)"
        total_text = f"{accumulation} = accumulation × {ranks} rank{plural}"
    else:
        micro, micro_text = train.micro_batch_size, f"train.micro_batch_size={train.micro_batch_size}"
        total_text = f"train.global_batch_size={train.global_batch_size}"
    unit = "tokens" if is_budgeted(data) else "sequences"
    global_key = "train.global_batch_tokens" if is_budgeted(data) else "train.global_batch_size"
    return {
        "train_micro_batch_size_per_gpu": (micro, micro_text),
        "gradient_accumulation_steps": (
            accumulation,
            f"{accumulation} (from {global_key} over {ranks} rank{plural}, in {unit})",
        ),
        "train_batch_size": (micro * accumulation * ranks, total_text),
        **clipping,
    }


def _read_deepspeed_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"DeepSpeed config file '{path}' (deepspeed_config_file) not found; fix the path")
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}); fix the DeepSpeed config") from None
    except (OSError, UnicodeDecodeError) as e:
        why = "not UTF-8" if isinstance(e, UnicodeDecodeError) else e.strerror or str(e)
        raise RecipeError(f"{path}: cannot read the DeepSpeed config ({why})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a DeepSpeed config must be a JSON object")
    return data


def _deepspeed_sources(env: Mapping[str, str]) -> list[tuple[str, dict]]:
    """(where, DeepSpeed values) of what the launch set: the accelerate config's deepspeed_config fields (or
    --gradient_accumulation_steps/--gradient_clipping), then the DeepSpeed config file it names."""
    sources: list[tuple[str, dict]] = [
        (
            "the accelerate config (deepspeed_config)",
            {
                "gradient_accumulation_steps": env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                "gradient_clipping": env.get("ACCELERATE_GRADIENT_CLIPPING"),
            },
        )
    ]
    ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if ds_file and ds_file.lower() != "none":
        sources.append((ds_file, _read_deepspeed_file(ds_file)))
    return sources


def _same_number(value, expected) -> bool:
    try:
        return float(value) == float(expected)
    except (TypeError, ValueError):
        return False


def _batch_problems(where: str, values: dict, recipe: dict[str, tuple[float, str]]) -> list[str]:
    """DeepSpeed batch and clipping keys set (not "auto") to another value than the recipe's."""
    return [
        f'DeepSpeed {key}={values[key]} in {where} disagrees with the recipe\'s {recipe_text}; set it to "auto" '
        "(or remove it) so the recipe decides"
        for key, (expected, recipe_text) in recipe.items()
        if values.get(key) is not None
        and str(values[key]).lower() != "auto"
        and not _same_number(values[key], expected)
    ]


def _section_problems(where: str, values: dict, precision: str) -> list[str]:
    """DeepSpeed optimizer/scheduler sections (they replace the recipe's), and bf16/fp16 enabled against it."""
    problems = [
        f'{where} has a DeepSpeed "{key}" section, which would replace the recipe\'s {recipe_keys}; '
        f"remove the section and set {recipe_keys} in the recipe"
        for key, recipe_keys in (("optimizer", "optim.*"), ("scheduler", "schedule.*"))
        if key in values
    ]
    for key in ("bf16", "fp16"):
        section = values.get(key)
        enabled = section.get("enabled") if isinstance(section, dict) else None
        if enabled is not None and str(enabled).lower() != "auto" and bool(enabled) != (precision == key):
            problems.append(
                f"DeepSpeed {key}.enabled={str(enabled).lower()} in {where} disagrees with the recipe's "
                f'train.precision={precision}; set it to "auto" so the recipe decides'
            )
    return problems


def _deepspeed_problems(train: TrainConfig, data: DataConfig, plan: RunPlan, env: Mapping[str, str]) -> list[str]:
    recipe = _recipe_batch(train, data, plan)
    problems = []
    for where, values in _deepspeed_sources(env):
        problems += _batch_problems(where, values, recipe)
        problems += _section_problems(where, values, train.precision)
    return problems


def check_launch(
    train: TrainConfig, optim: OptimConfig, data: DataConfig, plan: RunPlan, env: Mapping[str, str] = os.environ
) -> None:
    """One RecipeError listing every way the launcher's settings contradict the recipe and its plan (resolved for
    the launch's ranks: a rank count that does not divide the global batch failed there); nothing when they agree."""
    problems = []
    precision = _precision_problem(train.precision, env)
    if precision:
        problems.append(precision)
    if uses_deepspeed(env):
        problems += _deepspeed_problems(train, data, plan, env)
        if optim.name in ("lamb", "lars"):
            # ZeRO hands the optimizer flat partitions of many tensors: per-tensor trust ratios would be wrong
            problems.append(
                f"optim.name={optim.name} computes a trust ratio per parameter tensor, which DeepSpeed ZeRO's flat "
                "partitions do not keep; use accelerate_configs/fsdp2.yaml or ddp.yaml, or optim.name=adamw"
            )
    if uses_fsdp(env) and _true(env.get("FSDP_ACTIVATION_CHECKPOINTING")) and train.gradient_checkpointing:
        problems.append(
            "the accelerate config sets fsdp_activation_checkpointing and the recipe sets "
            "train.gradient_checkpointing=true; keep one (FSDP's is the one that works with sharded layers)"
        )
    if problems:
        raise RecipeError("; and ".join(problems))


def accelerator_config(train: TrainConfig) -> dict:
    """TrainingArguments(accelerator_config=...): with train.sync_each_batch, gradients are reduced after every
    micro-batch instead of once per window (more communication, but no unsharded gradient held under FSDP)."""
    return {"gradient_accumulation_kwargs": {"sync_each_batch": train.sync_each_batch}}


def _fsdp_plugin():
    from accelerate.state import AcceleratorState

    state = AcceleratorState()
    return getattr(state, "fsdp_plugin", None) if state.initialized else None


def consolidate_final_save() -> None:
    """Under FSDP, checkpoints during training stay sharded (SHARDED_STATE_DICT: each rank writes its shard, fast,
    and resume reads them back); the model saved after training is gathered whole, so the output folder holds a
    plain safetensors model. Trainer.save_model writes no model file at all while the type is SHARDED_STATE_DICT."""
    plugin = _fsdp_plugin()
    if plugin is not None and "SHARDED_STATE_DICT" in str(plugin.state_dict_type):
        plugin.set_state_dict_type("FULL_STATE_DICT")


@contextlib.contextmanager
def full_state_dict(plugin=None):
    """Trainer.save_model inside writes a whole safetensors model under FSDP too (gathered on rank 0), as the final
    save does; checkpoints after it stay sharded. `plugin`: accelerate's FSDP plugin (default: the running one)."""
    plugin = plugin if plugin is not None else _fsdp_plugin()
    if plugin is None or "SHARDED_STATE_DICT" not in str(plugin.state_dict_type):
        yield
        return
    saved = plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config = saved


def reduce_in_fp32(plugin=None) -> None:
    """FSDP2 under bf16/fp16: gradients accumulated over the window and reduced over the ranks in float32.

    accelerate's default policy (param_dtype = reduce_dtype = the 16-bit type) holds the unsharded gradient of an
    accumulation window in bf16 and reduce-scatters it in bf16: less exact than DDP, whose fp32 parameters get fp32
    gradients. With reduce_dtype=float32, FSDP2 accumulates unsynced gradients in float32 and reduces in float32 (twice
    the gradient communication of bf16). `plugin`: accelerate's FSDP plugin (default: the running one)."""
    plugin = plugin if plugin is not None else _fsdp_plugin()
    policy = getattr(plugin, "mixed_precision_policy", None)
    if getattr(plugin, "fsdp_version", 1) != 2 or policy is None or policy.param_dtype is None:
        return
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy.param_dtype in (torch.bfloat16, torch.float16) and policy.reduce_dtype != torch.float32:
        plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=torch.float32,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )


def callbacks() -> list:
    """Trainer callbacks for the launched strategy (none outside FSDP)."""
    if not uses_fsdp():
        return []
    from transformers import TrainerCallback

    class ConsolidateFinalSave(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            consolidate_final_save()  # after the last checkpoint, before train() saves the model

    return [ConsolidateFinalSave()]
