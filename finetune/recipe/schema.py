"""The recipe schema: a tree of dataclasses (defaults and comments say what each key means), the one place where
each key's choices are written (`one_of`; `CHOICES` and `choice_error` derive from it), and the error every recipe
mistake becomes. `finetune/recipe/loading.py` loads recipes onto it; `finetune/recipe/checks.py` checks them."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING

from finetune.recipe.batch_modes import MODES


class RecipeError(ValueError):
    """A problem with the recipe or its inputs that the user can fix; printed as one line, exit code 2."""


def first_line(error: BaseException) -> str:
    """An exception worded for a user's one-line message: its first line, or its type's name when it has no text."""
    text = str(error)
    return text.splitlines()[0] if text.strip() else type(error).__name__


def one_of(*choices: str, default: str | None = None) -> Any:
    """A key whose value is one of `choices` (default: the first)."""
    return field(default=choices[0] if default is None else default, metadata={"choices": choices})


def number(
    default: Any = None,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    max_exclusive: bool = False,
    count: int | None = None,
    hint: str = "",
) -> Any:
    """A numeric key (or a list or map of numbers, each checked): finite, within [min, max] (or the open ends).
    `checks.check_numbers` checks every such key and words its message from these bounds; `count`: a list's length,
    `hint`: what the bound means, added to the message."""
    bounds = {
        "min": min,
        "max": max,
        "min_exclusive": min_exclusive,
        "max_exclusive": max_exclusive,
        "count": count,
        "hint": hint,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"number": bounds})
    return field(default=default, metadata={"number": bounds})


def mapping(keys: tuple[str, ...] = (), values: tuple[str, ...] = ()) -> Any:
    """A map key (default empty) whose own keys, or values, are one of `keys` / `values` where given;
    `checks.check_mappings` checks every such key."""
    return field(default_factory=dict, metadata={"mapping": {"keys": keys, "values": values}})


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = number(8, min=1)
    alpha: int = number(16, min=0, min_exclusive=True)
    dropout: float = number(0.0, min=0, max=1, max_exclusive=True)
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "v_proj"])  # names, or all-linear
    merge: bool = False  # the final save (and best/) is the merged full model; the adapter beside it in adapter/


@dataclass
class ModelConfig:
    name_or_path: str = MISSING  # hub id, local folder, or `pkg:PACKAGE` for a model shipped inside a Python package
    gguf_file: str | None = None  # a GGUF inside name_or_path; converted once to a plain folder in the cache
    dtype: str = one_of("float32", "bfloat16", "float16")  # the dtype the weights are loaded in
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
class MixtureSource:
    """One source of data.mixture, read with the data.* keys except those it sets itself."""

    source: str = MISSING  # as data.source
    weight: float = 1.0  # its share of the training rows: weight / the sum of the weights
    name: str | None = None  # in the data line and eval_<name>_loss; default: the file's stem (or the source)
    format: str | None = None  # default: data.format
    loss_on: str | None = None  # default: data.loss_on
    split: str | None = None  # a hub dataset's split; default: data.split


# the fields of a data row that data.columns can read from a column of another name (finetune/data/formats.py)
ROW_FIELDS = (
    "messages",
    "conversations",
    "instruction",
    "input",
    "output",
    "system",
    "history",
    "prompt",
    "completion",
    "text",
)


@dataclass
class DataConfig:
    source: str = "stdlib_docs"  # stdlib_docs | shapes_captions | a jsonl/json/parquet/csv file or folder | a hub id
    split: str = "train"
    # auto: the first whose columns a row has: messages, conversations (sharegpt), instruction + output (alpaca),
    # prompt + completion, text. ShareGPT and Alpaca rows become messages (docs/data.md shows a row of each)
    format: str = one_of("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")
    # {field: your column}, read as that field (e.g. {prompt: question, completion: answer}); fields: messages,
    # conversations, instruction, input, output, system, history, prompt, completion, text
    columns: dict[str, str] = mapping(keys=ROW_FIELDS)
    # {your role name: ours} for messages and conversations (e.g. {bot: assistant}); ShareGPT's human, gpt,
    # observation (tool) and function_call (assistant) are known without it
    roles: dict[str, str] = mapping(values=("user", "assistant", "system", "tool"))
    # the keys a message of messages or conversations has, e.g. {role: from, content: value}; default: role and
    # content for messages, from and value for conversations (ShareGPT)
    message_keys: dict[str, str] = mapping(keys=("role", "content"))
    max_length: int = number(1024, min=1)
    truncation: str = one_of("right", "drop", "error")
    loss_on: str = one_of("assistant", "completion", "all")
    on_bad_row: str = one_of("error", "skip")
    limit: int | None = number(None, min=1)  # keep the first N rows (quick runs)
    batching: str = one_of(*MODES)  # finetune/recipe/batch_modes.py says what each does
    max_tokens_per_micro_batch: int | None = number(None, min=1)  # token_budget only
    num_workers: int = number(0, min=0)
    streaming: bool = False  # read, tokenize and label rows as training goes (data larger than memory)
    chat_template: str | None = None  # chatml (built in) or a Jinja file: replaces the tokenizer's chat template
    # several sources drawn at chosen shares (seeded) instead of data.source: [{source, weight, name, format, …}]
    mixture: list[MixtureSource] = field(default_factory=list)


@dataclass
class TrainConfig:
    output_dir: str = "outputs/run"
    # sequences per micro-batch per rank, or auto: the largest that fits this machine with the global batch kept
    # (`python -m finetune.plan` shows the choice; training plans it at start)
    micro_batch_size: int | str = number(8, min=1)
    global_batch_size: int = number(8, min=1)  # sequences per optimizer step over all ranks
    # computed tokens per optimizer step, for token-budgeted batching
    global_batch_tokens: int | None = number(None, min=1)
    max_steps: int = number(-1, min=-1, hint="-1: train for train.epochs")
    epochs: float = number(1.0, min=0)
    precision: str = one_of("fp32", "bf16", "fp16")
    max_grad_norm: float = number(1.0, min=0, hint="0 turns clipping off")
    seed: int = number(42, min=0, max=2**32 - 1)  # NumPy's seed range
    save_steps: int = number(0, min=0, hint="0: save only at the end")
    save_total_limit: int | None = number(None, min=1)  # checkpoints kept (None: all)
    resume_from: str | None = None  # auto (the newest complete checkpoint in output_dir, else start) | PATH
    # a resume whose data order would differ (other data, seed, ranks or batch sizes): an error, or allowed
    resume_data_order_change: str = one_of("error", "allow")
    # NaN/inf loss or gradients: skip the update (counted as nonfinite_skipped), or stop the run
    on_nonfinite: str = one_of("skip", "stop")
    gradient_checkpointing: bool = False
    profile_steps: list[int] = number([], min=1)  # [first, last] optimizer steps under torch.profiler
    sync_each_batch: bool = False  # reduce gradients after every micro-batch: less memory under FSDP, more traffic


@dataclass
class OptimConfig:
    name: str = one_of("adamw", "sgd", "lamb", "lars")
    lr: float = number(1e-4, min=0, min_exclusive=True)
    weight_decay: float = number(0.0, min=0)
    betas: list[float] = number([0.9, 0.999], min=0, max=1, max_exclusive=True, count=2)
    eps: float = number(1e-8, min=0)
    momentum: float = number(0.9, min=0, max=1, max_exclusive=True)  # sgd, lars
    trust_coefficient: float = number(0.001, min=0, min_exclusive=True)  # lars
    lr_scaling: str = one_of("none", "linear", "sqrt")
    # the batch optim.lr was tuned for (with lr_scaling)
    base_batch_size: int | None = number(None, min=0, min_exclusive=True)
    # module-name prefix -> lr factor
    lr_multipliers: dict[str, float] = number({}, min=0, min_exclusive=True, hint="model.freeze keeps modules fixed")


@dataclass
class ScheduleConfig:
    name: str = one_of("onecycle", "warmup_cosine", "linear", "constant", default="constant")
    warmup_steps: int = number(0, min=0)
    warmup_ratio: float = number(0.0, min=0, max=1, max_exclusive=True)
    warmup: str = one_of("linear", "quadratic", "constant")
    warmup_factor: float = number(0.1, min=0, max=1, min_exclusive=True)  # the lr factor held during a constant warmup
    min_lr_ratio: float = number(0.0, min=0, max=1)  # warmup_cosine floor, as a fraction of the peak lr
    pct_start: float = number(0.1, min=0, max=1, min_exclusive=True, max_exclusive=True)  # onecycle
    div_factor: float = number(25.0, min=0, min_exclusive=True)  # onecycle: initial lr = peak / div_factor
    final_div_factor: float = number(1e4, min=0, min_exclusive=True)  # onecycle: final lr = initial / final_div_factor
    anneal: str = one_of("cos", "linear")  # onecycle


@dataclass
class LogConfig:
    # auto: online when a W&B API key is found (WANDB_API_KEY or ~/.netrc) and the service answers within 3 s, else
    # offline (runs land in train.output_dir/wandb; `wandb sync` uploads them later); online: an error without either
    wandb_mode: str = one_of("auto", "offline", "online", "disabled")
    wandb_project: str = "finetune"
    run_name: str | None = None
    every_steps: int = number(1, min=1)
    # the device's peak TFLOP/s for MFU; default: a table of common GPUs
    peak_tflops: float | None = number(None, min=0, min_exclusive=True)


@dataclass
class EvalConfig:
    # The eval set. Empty: rows held out of data.source (eval.fraction; stdlib_docs holds out whole modules), else a
    # stdlib_docs | shapes_captions | jsonl/json/parquet/csv file or folder | hub id, read with the data.* keys
    source: str | None = None
    split: str = "validation"  # the split of a hub dataset eval.source (and of eval.sets)
    # named eval sets {name: source}, each logged as eval_<name>_loss; eval_loss is the mean over all their tokens.
    # With data.mixture, eval.fraction holds out of each source, named as the mixture names it
    sets: dict[str, str] = field(default_factory=dict)
    # what the best model and early stopping follow: eval_loss, eval_token_accuracy, eval_<name>_loss, …
    metric: str = "eval_loss"
    # share of data.source held out (seeded by train.seed), never trained on; 0: no held-out rows
    fraction: float = number(0.0, min=0, max=1, max_exclusive=True, hint="the share of data.source held out")
    # evaluate on N rows: the first N of eval.source, or N held-out rows in a seeded order
    limit: int | None = number(None, min=1)
    # optimizer steps between evaluations; 0: only before the first step and at the end
    every_steps: int = number(0, min=0)
    batching: str = one_of(*MODES, default="packed")  # as data.batching
    micro_batch_size: int = number(8, min=1)  # rows per eval micro-batch (per rank)
    max_tokens_per_micro_batch: int | None = number(None, min=1)  # token_budget, or packed by tokens
    # held-out prompts generated from (greedy) at each evaluation: console and a W&B table
    samples: int = number(2, min=0)
    prompts: list[str] = field(default_factory=list)  # your own prompts, generated from beside them
    max_new_tokens: int = number(48, min=1)
    best_checkpoint: bool = False  # keep the model of the lowest eval loss in train.output_dir/best
    early_stopping_patience: int = number(0, min=0)  # stop after N evaluations without a lower eval loss; 0: never


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    recipe: str | None = None  # the YAML file this config came from


# maps whose keys the user names (the data.* maps: checked by checks.check_mappings)
OPEN_DICTS = (
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
