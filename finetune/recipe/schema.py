"""The recipe schema: a tree of dataclasses, the one place where each key's default, one-line description (`help=`,
printed by `--help`: finetune/recipe/usage.py) and choices are written (`one_of`; `CHOICES` and `choice_error` derive
from it), and the error every recipe mistake becomes. `finetune/recipe/loading.py` loads recipes onto it;
`finetune/recipe/checks.py` checks them."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from omegaconf import MISSING

from finetune.recipe.batch_modes import MODES
from finetune.recipe.data_schema import DataConfig
from finetune.recipe.fields import RecipeError, number, one_of, section, setting


@dataclass
class LoraConfig:
    """LoRA adapters instead of full fine-tuning (peft)."""

    enabled: bool = setting(False, help="train LoRA adapters; the base weights stay frozen")
    r: int = number(8, min=1, help="rank of each adapter")
    alpha: int = number(16, min=0, min_exclusive=True, help="scaling numerator: adapters are scaled by alpha / r")
    dropout: float = number(0.0, min=0, max=1, max_exclusive=True, help="dropout on the adapters' input")
    target_modules: list[str] | str = setting(
        ["q_proj", "v_proj"], help="module names that get adapters, or all-linear"
    )
    merge: bool = setting(
        False, help="the final save (and best/) is the merged full model; the adapter beside it in adapter/"
    )


@dataclass
class QuantizationConfig:
    """A quantized base (bitsandbytes through transformers' BitsAndBytesConfig; needs model.lora): docs/qlora.md."""

    bits: str = one_of("none", "4", "8", help="the base in 4-bit (QLoRA) or 8-bit (LLM.int8); none: model.dtype")
    bnb_4bit_quant_type: str = one_of("nf4", "fp4", help="the 4-bit data type: NormalFloat4 (QLoRA's) or FP4")
    bnb_4bit_use_double_quant: bool = setting(True, help="quantize the 4-bit blocks' scales too (~0.4 bit/param)")
    bnb_4bit_compute_dtype: str = one_of(
        "auto", "float32", "bfloat16", "float16", help="the dtype a 4-bit layer dequantizes to and multiplies in"
    )
    llm_int8_skip_modules: list[str] | None = setting(
        None,
        help="module names left unquantized; None: the output head (and a VLM's vision tower and projector)",
    )


@dataclass
class ModelConfig:
    """The model and its tokenizer: where they come from and how they load."""

    name_or_path: str = setting(
        MISSING, help="hub id, local folder, or pkg:PACKAGE for a model shipped inside a Python package"
    )
    gguf_file: str | None = setting(
        None, help="a GGUF inside name_or_path; converted once to a plain folder in the cache"
    )
    dtype: str = one_of("float32", "bfloat16", "float16", help="the dtype the weights are loaded in")
    from_config: bool = setting(
        False, help="random init from name_or_path's config (with config_overrides): tiny test models"
    )
    config_overrides: dict[str, Any] = setting(
        {}, help="model config fields changed before a from_config init ({hidden_size: 64, …})"
    )
    attn_implementation: str = setting(
        "auto",
        help="transformers' attn_implementation; auto: sdpa where the model has it, else eager (gpt-oss's sinks); or "
        "sdpa, eager, flex_attention, flash_attention_2",
    )
    trust_remote_code: bool = setting(False, help="let transformers run the model repository's own code")
    freeze: list[str] = setting([], help="module-name prefixes whose parameters do not train")
    lora: LoraConfig = section(LoraConfig)
    quantization: QuantizationConfig = section(QuantizationConfig)
    # Set to assemble a VLM: this language model + a vision tower built from this config (random init, cached once);
    # model_type picks which (siglip_vision_model, the default: a LLaVA; qwen2_5_vl: a Qwen2.5-VL), the other keys are
    # that tower config's fields. Empty: a VLM name_or_path (hub id or folder) is used as it is.
    vision_config: dict[str, Any] = setting(
        {},
        help="assemble a VLM from this language model and a new vision tower: model_type (siglip_vision_model: a "
        "LLaVA, the default; qwen2_5_vl: a Qwen2.5-VL) and that tower config's fields",
    )
    # speed lever, off by default: kept on only where the GPU measures it faster and exact (docs/gpu.md)
    liger_kernels: bool = setting(
        False, help="Liger's RMSNorm/SwiGLU/RoPE triton kernels under this trainer's head and loss (CUDA, text models)"
    )


@dataclass
class TrainConfig:
    """The run: batch sizes, length, precision, saving and resuming."""

    output_dir: str = setting("outputs/run", help="checkpoints, logs and the final model")
    # sequences per micro-batch per rank, or auto: the largest that fits this machine with the global batch kept
    # (`python -m finetune.plan` shows the choice; training plans it at start)
    micro_batch_size: int | str = number(
        8, min=1, help="sequences per micro-batch per rank, or auto: the largest that fits (finetune-plan shows it)"
    )
    global_batch_size: int = number(
        8, min=1, help="sequences per optimizer step over all ranks; accumulation is derived from it"
    )
    global_batch_tokens: int | None = number(
        None, min=1, help="computed tokens per optimizer step, for token-budgeted batching"
    )
    max_steps: int = number(-1, min=-1, hint="-1: train for train.epochs", help="optimizer steps; -1: train.epochs")
    epochs: float = number(1.0, min=0, help="passes over the data (when train.max_steps is -1)")
    precision: str = one_of("fp32", "bf16", "fp16", help="mixed precision of forward and backward (autocast)")
    max_grad_norm: float = number(1.0, min=0, hint="0 turns clipping off", help="gradient clipping norm; 0: off")
    seed: int = number(42, min=0, max=2**32 - 1, help="seeds init, data order, held-out rows")  # NumPy's seed range
    save_steps: int = number(
        0, min=0, hint="0: save only at the end", help="optimizer steps between checkpoints; 0: only at the end"
    )
    save_total_limit: int | None = number(None, min=1, help="checkpoints kept (None: all)")
    resume_from: str | None = setting(
        None, help="auto (the newest complete checkpoint in output_dir, else start) | PATH"
    )
    resume_data_order_change: str = one_of(
        "error", "allow", help="a resume whose data order would differ (data, seed, ranks, batch): error or allow"
    )
    on_nonfinite: str = one_of(
        "skip", "stop", help="NaN/inf loss or gradients: skip the update (counted) or stop the run (exit 3)"
    )
    moe_balance: str = one_of(
        "auto",
        "micro",
        "window",
        help="a mixture of experts' router balancing loss: each micro-batch's, averaged over the window (micro), or "
        "the whole window's over all ranks (window: a no-grad forward of the window first); auto: micro where the "
        "model's config turns the loss on, nothing to balance elsewhere",
    )
    gradient_checkpointing: bool = setting(False, help="recompute activations in backward: less memory, slower")
    activation_offloading: bool = setting(
        False, help="keep the forward's saved activations in host memory until backward (save_on_cpu): less GPU memory"
    )
    profile_steps: list[int] = number([], min=1, help="[first, last] optimizer steps under torch.profiler")
    sync_each_batch: bool = setting(
        False, help="reduce gradients after every micro-batch: less memory under FSDP, more traffic"
    )
    # speed lever, off by default: kept on only where the GPU measures it faster and exact (docs/gpu.md)
    compile_layers: bool = setting(
        False, help="torch.compile each decoder layer in place (dynamic shapes), compiled on its first micro-batch"
    )


@dataclass
class OptimConfig:
    """The optimizer and its learning rate."""

    name: str = one_of(
        "adamw",
        "sgd",
        "lamb",
        "lars",
        "adamw_8bit",
        "paged_adamw_8bit",
        "paged_adamw",
        help="the optimizer; adamw_8bit, paged_adamw_8bit, paged_adamw: bitsandbytes' (docs/qlora.md)",
    )
    lr: float = number(1e-4, min=0, min_exclusive=True, help="peak learning rate (before optim.lr_scaling)")
    weight_decay: float = number(0.0, min=0, help="weight decay (none on biases, norms, embeddings)")
    betas: list[float] = number(
        [0.9, 0.999], min=0, max=1, max_exclusive=True, count=2, help="Adam betas: adamw*, lamb"
    )
    eps: float = number(1e-8, min=0, help="added to the denominator: adamw*, lamb")
    momentum: float = number(0.9, min=0, max=1, max_exclusive=True, help="momentum: sgd, lars")
    trust_coefficient: float = number(0.001, min=0, min_exclusive=True, help="lars' trust coefficient")
    lr_scaling: str = one_of(
        "none", "linear", "sqrt", help="scale optim.lr from optim.base_batch_size to the global batch"
    )
    base_batch_size: int | None = number(
        None, min=0, min_exclusive=True, help="the global batch optim.lr was tuned for (with lr_scaling)"
    )
    lr_multipliers: dict[str, float] = number(
        {}, min=0, min_exclusive=True, hint="model.freeze keeps modules fixed", help="module-name prefix -> lr factor"
    )


@dataclass
class ScheduleConfig:
    """The learning-rate schedule over the run's optimizer steps."""

    name: str = one_of(
        "onecycle", "warmup_cosine", "linear", "constant", default="constant", help="the schedule after warmup"
    )
    warmup_steps: int = number(0, min=0, help="warmup length in optimizer steps (or warmup_ratio, not both)")
    warmup_ratio: float = number(0.0, min=0, max=1, max_exclusive=True, help="warmup as a share of the run's steps")
    warmup: str = one_of("linear", "quadratic", "constant", help="the warmup's shape")
    warmup_factor: float = number(
        0.1, min=0, max=1, min_exclusive=True, help="the lr factor held during a constant warmup"
    )
    min_lr_ratio: float = number(0.0, min=0, max=1, help="linear/warmup_cosine floor, as a fraction of the peak lr")
    pct_start: float = number(
        0.1, min=0, max=1, min_exclusive=True, max_exclusive=True, help="onecycle: share of steps rising"
    )
    div_factor: float = number(25.0, min=0, min_exclusive=True, help="onecycle: initial lr = peak / div_factor")
    final_div_factor: float = number(
        1e4, min=0, min_exclusive=True, help="onecycle: final lr = initial / final_div_factor"
    )
    anneal: str = one_of("cos", "linear", help="onecycle: the annealing shape")


@dataclass
class LogConfig:
    """Logging: W&B and the console."""

    # auto: online when a W&B API key is found (WANDB_API_KEY or ~/.netrc) and the service answers within 3 s, else
    # offline (runs land in train.output_dir/wandb; `wandb sync` uploads them later); online: an error without either
    wandb_mode: str = one_of(
        "auto",
        "offline",
        "online",
        "disabled",
        help="auto: online with an API key and a reachable service, else offline",
    )
    wandb_project: str = setting("finetune", help="the W&B project")
    run_name: str | None = setting(None, help="the run's name; default: RECIPE-gbGLOBAL_BATCH-lrLR")
    every_steps: int = number(1, min=1, help="optimizer steps between log lines")
    peak_tflops: float | None = number(
        None, min=0, min_exclusive=True, help="the device's peak TFLOP/s for MFU; default: a table of common GPUs"
    )


@dataclass
class EvalConfig:
    """Evaluation: the eval set, how often, samples, best checkpoint and early stopping."""

    # The eval set. Empty: rows held out of data.source (eval.fraction; stdlib_docs holds out whole modules), else a
    # stdlib_docs | shapes_captions | jsonl/json/parquet/csv file or folder | hub id, read with the data.* keys
    source: str | None = setting(
        None, help="the eval set (read with the data.* keys); empty: rows held out of data.source (eval.fraction)"
    )
    split: str = setting("validation", help="the split of a hub dataset eval.source (and of eval.sets)")
    # With data.mixture, eval.fraction holds out of each source, named as the mixture names it
    sets: dict[str, str] = setting({}, help="named eval sets {name: source}, each logged as eval_<name>_loss")
    metric: str = setting(
        "eval_loss", help="what the best model and early stopping follow: eval_loss, eval_<name>_loss, …"
    )
    fraction: float = number(
        0.0,
        min=0,
        max=1,
        max_exclusive=True,
        hint="the share of data.source held out",
        help="share of data.source held out (seeded by train.seed), never trained on; 0: none",
    )
    limit: int | None = number(
        None, min=1, help="evaluate on N rows: the first N of eval.source, or N held-out rows (seeded)"
    )
    every_steps: int = number(
        0, min=0, help="optimizer steps between evaluations; 0: only before the first step and at the end"
    )
    batching: str = one_of(*MODES, default="packed", help="as data.batching, for the eval set")
    micro_batch_size: int = number(8, min=1, help="rows per eval micro-batch (per rank)")
    max_tokens_per_micro_batch: int | None = number(None, min=1, help="token_budget, or packed by tokens")
    samples: int = number(
        2, min=0, help="held-out prompts generated from (greedy) at each evaluation: console and W&B table"
    )
    prompts: list[str] = setting([], help="your own prompts, generated from beside them")
    max_new_tokens: int = number(48, min=1, help="tokens generated per sample")
    best_checkpoint: bool = setting(False, help="keep the model of the lowest eval loss in train.output_dir/best")
    early_stopping_patience: int = number(0, min=0, help="stop after N evaluations without a lower eval loss; 0: never")


@dataclass
class Config:
    """A recipe."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    train: TrainConfig = section(TrainConfig)
    optim: OptimConfig = section(OptimConfig)
    schedule: ScheduleConfig = section(ScheduleConfig)
    log: LogConfig = section(LogConfig)
    eval: EvalConfig = section(EvalConfig)
    recipe: str | None = setting(None, help="the YAML file this config came from (set by recipe=)")


# maps whose keys the user names (the data.* maps: checked by checks.check_mappings)
OPEN_DICTS = (  # maps whose keys the user names (the data.* maps: checked by checks.check_mappings)
    "model.config_overrides",
    "model.vision_config",
    "optim.lr_multipliers",
    "eval.sets",
    "data.columns",
    "data.roles",
    "data.message_keys",
)


def _choices(section: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    found = {}
    for f in fields(section):
        if "choices" in f.metadata:
            found[prefix + f.name] = f.metadata["choices"]
        elif is_dataclass(f.default_factory):
            found.update(_choices(f.default_factory, f"{prefix}{f.name}."))
    return found


CHOICES: dict[str, tuple[str, ...]] = _choices(Config)  # "optim.name" -> ("adamw", "sgd", "lamb", "lars"), …


def choice_error(key: str, value: Any) -> RecipeError:
    """`key=value` is not one of the key's choices: the one message for it, with the closest choice as a hint."""
    allowed = CHOICES[key]
    guess = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f"; did you mean '{guess[0]}'?" if guess else ""
    return RecipeError(f"{key}={value!r} is not one of {', '.join(allowed)}{hint}")
