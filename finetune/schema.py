"""The recipe schema: a tree of dataclasses (defaults and comments say what each key means), its choices, and the
error every recipe mistake becomes. `finetune/config.py` loads recipes onto it; `finetune/checks.py` checks them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from omegaconf import MISSING


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
