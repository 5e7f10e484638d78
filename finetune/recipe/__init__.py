"""The recipe: what a run is asked to do, checked before anything heavy loads.

Owns the schema (dataclasses: every key, its default and its choices, written once), loading a YAML recipe with
`key=value` overrides onto it (`load_config`, built-in recipes by name, the `TOOL.key=value` splitter of plan and
verify), the cross-field checks and what the global batch implies (accumulation). Imports only the standard
library, PyYAML, OmegaConf and `finetune.env`: no torch, no transformers, so every entry point reports a recipe
mistake in a second. Everything else in finetune may import it; it imports nothing else of finetune.
"""

from finetune.recipe.batch_modes import MODES, Batching
from finetune.recipe.checks import accumulation_steps, check_config, is_budgeted
from finetune.recipe.data_schema import MixtureSource
from finetune.recipe.fields import RecipeError, first_line
from finetune.recipe.loading import load_config, recipe_file, split_tool_args, to_tree, to_yaml
from finetune.recipe.run_plan import RunPlan, resolve_plan
from finetune.recipe.schema import (
    CHOICES,
    OPEN_DICTS,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    QuantizationConfig,
    ScheduleConfig,
    TrainConfig,
    choice_error,
)
from finetune.recipe.set_checks import eval_batching, eval_set_names, evaluates, mixture_names, training_batching

__all__ = [
    "RunPlan",
    "resolve_plan",
    "MODES",
    "Batching",
    "eval_batching",
    "training_batching",
    "CHOICES",
    "OPEN_DICTS",
    "Config",
    "DataConfig",
    "EvalConfig",
    "LogConfig",
    "LoraConfig",
    "QuantizationConfig",
    "MixtureSource",
    "ModelConfig",
    "OptimConfig",
    "RecipeError",
    "ScheduleConfig",
    "TrainConfig",
    "accumulation_steps",
    "check_config",
    "choice_error",
    "eval_set_names",
    "evaluates",
    "mixture_names",
    "first_line",
    "is_budgeted",
    "load_config",
    "recipe_file",
    "split_tool_args",
    "to_tree",
    "to_yaml",
]
