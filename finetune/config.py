"""The recipe schema (a tree of dataclasses) and `load_config(argv)`.

YAML, then `key=value` overrides, merge onto the schema in OmegaConf struct mode, so an unknown key or a value of the
wrong type is an error at load time. Cross-field checks live here too, in the user's key names.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError


class RecipeError(ValueError):
    """A problem with the recipe or its inputs that the user can fix; printed as one line, exit code 2."""


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


@dataclass
class ModelConfig:
    name_or_path: str = MISSING  # hub id, local folder, or `pkg:PACKAGE` for a model shipped inside a Python package
    gguf_file: Optional[str] = None  # a GGUF inside name_or_path; converted once to a plain folder in the cache
    dtype: str = "float32"  # float32 | bfloat16 | float16: the dtype the weights are loaded in
    from_config: bool = False  # random init from name_or_path's config (with config_overrides): tiny test models
    config_overrides: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    freeze: list[str] = field(default_factory=list)  # module-name prefixes whose parameters do not train
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Set (SiglipVisionConfig fields) to assemble a LLaVA: this language model + a vision tower built from this config
    # (random init, cached once). Empty: a VLM name_or_path (hub id or folder) is used as it is.
    vision_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    source: str = "stdlib_docs"  # stdlib_docs | a jsonl/json/parquet/csv file or folder | a hub dataset id
    split: str = "train"
    format: str = "auto"  # auto | messages | prompt_completion | text
    max_length: int = 1024
    truncation: str = "right"  # right | drop | error
    loss_on: str = "assistant"  # assistant | completion | all
    on_bad_row: str = "error"  # error | skip
    limit: Optional[int] = None  # keep the first N rows (quick runs)
    batching: str = "padded"  # padded | length_grouped | token_budget | packed
    max_tokens_per_micro_batch: Optional[int] = None  # token_budget only
    num_workers: int = 0
    streaming: bool = False  # read, tokenize and label rows as training goes (data larger than memory)


@dataclass
class TrainConfig:
    output_dir: str = "outputs/run"
    # sequences per micro-batch per rank, or auto: the largest that fits this machine with the global batch kept
    # (`python -m finetune.plan` shows the choice; training plans it at start)
    micro_batch_size: Union[int, str] = 8
    global_batch_size: int = 8  # sequences per optimizer step over all ranks
    global_batch_tokens: Optional[int] = None  # computed tokens per optimizer step, for token-budgeted batching
    max_steps: int = -1
    epochs: float = 1.0
    precision: str = "fp32"  # fp32 | bf16 | fp16
    max_grad_norm: float = 1.0
    seed: int = 42
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: Optional[int] = None
    resume_from: Optional[str] = None  # auto (the newest complete checkpoint in output_dir, else start) | PATH
    on_nonfinite: str = "skip"  # NaN/inf loss or gradients: skip the update (counted as nonfinite_skipped) | stop
    gradient_checkpointing: bool = False
    profile_steps: list[int] = field(default_factory=list)  # [first, last] optimizer steps under torch.profiler
    sync_each_batch: bool = False  # reduce gradients after every micro-batch: less memory under FSDP, more traffic


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd | lamb | lars
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.9  # sgd, lars
    trust_coefficient: float = 0.001  # lars
    lr_scaling: str = "none"  # none | linear | sqrt
    base_batch_size: Optional[int] = None  # the batch optim.lr was tuned for (with lr_scaling)
    lr_multipliers: dict[str, float] = field(default_factory=dict)  # module-name prefix -> lr factor


@dataclass
class ScheduleConfig:
    name: str = "constant"  # onecycle | warmup_cosine | linear | constant
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    warmup: str = "linear"  # linear | quadratic | constant
    warmup_factor: float = 0.1  # the lr factor held during a constant warmup
    min_lr_ratio: float = 0.0  # warmup_cosine floor, as a fraction of the peak lr
    pct_start: float = 0.1  # onecycle
    div_factor: float = 25.0  # onecycle: initial lr = peak / div_factor
    final_div_factor: float = 1e4  # onecycle: final lr = initial / final_div_factor
    anneal: str = "cos"  # onecycle: cos | linear


@dataclass
class LogConfig:
    # auto: online when a W&B API key is found (WANDB_API_KEY or ~/.netrc), else offline (runs land in
    # train.output_dir/wandb; `wandb sync` uploads them later) | offline | online | disabled
    wandb_mode: str = "auto"
    wandb_project: str = "finetune"
    run_name: Optional[str] = None
    every_steps: int = 1
    peak_tflops: Optional[float] = None  # the device's peak TFLOP/s for MFU; default: a table of common GPUs


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    log: LogConfig = field(default_factory=LogConfig)
    recipe: Optional[str] = None  # the YAML file this config came from


OPEN_DICTS = ("model.config_overrides", "model.vision_config", "optim.lr_multipliers")

CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "data.format": ("auto", "messages", "prompt_completion", "text"),
    "data.truncation": ("right", "drop", "error"),
    "data.loss_on": ("assistant", "completion", "all"),
    "data.on_bad_row": ("error", "skip"),
    "data.batching": ("padded", "length_grouped", "token_budget", "packed"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.on_nonfinite": ("skip", "stop"),
    "optim.name": ("adamw", "sgd", "lamb", "lars"),
    "optim.lr_scaling": ("none", "linear", "sqrt"),
    "schedule.name": ("onecycle", "warmup_cosine", "linear", "constant"),
    "schedule.warmup": ("linear", "quadratic", "constant"),
    "schedule.anneal": ("cos", "linear"),
    "log.wandb_mode": ("auto", "offline", "online", "disabled"),
}


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}{key}"
            keys.append(path)
            keys += _all_keys(node._get_node(key), path + ".")
    return keys


def _unknown_key_error(key: str, where: str, schema: DictConfig) -> RecipeError:
    known = _all_keys(schema)
    guess = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not guess:  # a typo in the leaf only: compare with the leaves
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
        guess = [by_leaf[g] for g in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    hint = f"; did you mean '{guess[0]}'?" if guess else "; see finetune/config.py for the keys"
    return RecipeError(f"{where}: unknown key '{key}'{hint}")


def _merge(schema: DictConfig, other: DictConfig, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(schema, other)
    except (ConfigAttributeError, ConfigKeyError) as e:
        key = e.full_key or str(e.key)
        raise _unknown_key_error(key, where, schema) from None
    except ValidationError as e:
        raise RecipeError(f"{where}: {e.full_key}={e.value!r} is not a valid {_type_name(e)}; fix the value") from None
    except OmegaConfBaseException as e:
        raise RecipeError(f"{where}: {str(e).splitlines()[0]}") from None


def _type_name(e: ValidationError) -> str:
    msg = str(e).splitlines()[0]
    for word in ("Integer", "Float", "Boolean", "String"):
        if word in msg:
            return {"Integer": "integer", "Float": "number", "Boolean": "boolean (true/false)", "String": "string"}[word]
    return "value for this key"


def _read_recipe(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"recipe file '{path}' not found; pass recipe=PATH to an existing YAML file (see recipes/)")
    try:
        data = yaml.safe_load(file.read_text())  # safe_load: a recipe can never construct Python objects
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections (model:, data:, train:, …)")
    return data


def _parse_override(arg: str) -> tuple[str, Any]:
    if "=" not in arg:
        raise RecipeError(f"argument '{arg}' is not key=value; write e.g. optim.lr=1e-5 or recipe=recipes/debug.yaml")
    key, value = arg.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def load_config(argv: list[str]) -> Config:
    """`recipe=PATH` (at most one) and `key=value` overrides, in order, onto the schema; then the cross-field checks."""
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    for key in OPEN_DICTS:  # free-form maps: their keys belong to the model or the user, not to the schema
        OmegaConf.set_struct(OmegaConf.select(schema, key), False)
    overrides = [_parse_override(a) for a in argv]
    recipes = [v for k, v in overrides if k == "recipe"]
    if len(recipes) > 1:
        raise RecipeError("recipe= given more than once; pass one recipe and override keys with key=value")
    cfg = schema
    if recipes:
        path = str(recipes[0])
        cfg = _merge(cfg, OmegaConf.create(_read_recipe(path)), path)
        cfg.recipe = path
    for key, value in overrides:
        if key == "recipe":
            continue
        dotted = OmegaConf.from_dotlist([])
        try:
            OmegaConf.update(dotted, key, value, force_add=True)
        except OmegaConfBaseException:
            raise RecipeError(f"override '{key}={value}': not a valid key") from None
        cfg = _merge(cfg, dotted, "command line")
    missing = sorted(k for k in OmegaConf.missing_keys(cfg))
    if missing:
        raise RecipeError(f"{', '.join(missing)} must be set; add it to the recipe or pass {missing[0]}=…")
    config: Config = OmegaConf.to_object(cfg)
    check_config(config)
    return config


def _get(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def data_parallel_ranks() -> int:
    """Ranks the launcher started (accelerate launch and torchrun set WORLD_SIZE); known before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_budgeted(data: DataConfig) -> bool:
    """Micro-batches filled up to `data.max_tokens_per_micro_batch` rather than a fixed row count."""
    return data.batching == "token_budget" or (data.batching == "packed" and bool(data.max_tokens_per_micro_batch))


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
        value = _get(config, key)
        if value not in allowed:
            guess = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f"; did you mean '{guess[0]}'?" if guess else ""
            raise RecipeError(f"{key}={value!r} is not one of {', '.join(allowed)}{hint}")
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
        raise RecipeError(f"train.profile_steps={list(profile)} must be [first, last] optimizer steps, 1 ≤ first ≤ last")
    if config.log.peak_tflops is not None and config.log.peak_tflops <= 0:
        raise RecipeError(f"log.peak_tflops={config.log.peak_tflops} must be positive (the device's peak TFLOP/s)")
    if config.train.max_grad_norm < 0:
        raise RecipeError(f"train.max_grad_norm={config.train.max_grad_norm} must be ≥ 0 (0 turns clipping off)")
    if config.data.streaming and config.train.max_steps < 1:
        raise RecipeError("data.streaming=true has no dataset length to count epochs by; set train.max_steps")
    if config.data.streaming and (config.data.batching == "length_grouped" or is_budgeted(config.data)):
        raise RecipeError(
            f"data.batching={config.data.batching} sorts or budgets rows by length, which a stream does not know up "
            "front; use data.batching=padded or packed (without data.max_tokens_per_micro_batch), or data.streaming=false"
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
    if config.train.precision == "fp16" and config.model.dtype != "float32":
        raise RecipeError(
            "train.precision=fp16 trains float32 weights under a GradScaler; set model.dtype=float32 "
            "(or use train.precision=bf16)"
        )
    if micro != "auto":
        accumulation_steps(config, data_parallel_ranks())
    elif is_budgeted(config.data):
        raise RecipeError(f"train.micro_batch_size=auto plans sequences per micro-batch; data.batching="
                          f"{config.data.batching} fills micro-batches by tokens: run python -m finetune.plan to choose "
                          "data.max_tokens_per_micro_batch")
    elif config.train.global_batch_size % data_parallel_ranks():
        raise RecipeError(f"train.global_batch_size={config.train.global_batch_size} is not divisible by the "
                          f"{data_parallel_ranks()} ranks; set a multiple of {data_parallel_ranks()}")


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
