"""`load_config(argv)`: a recipe and its `key=value` overrides onto the schema (finetune/schema.py), checked.

YAML, then `key=value` overrides, merge onto the schema in OmegaConf struct mode, so an unknown key or a value of the
wrong type is an error at load time; then the cross-field checks (finetune/checks.py), in the user's key names.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

# The schema and the checks are re-exported: `from finetune.config import …` is the recipe's one public face.
from finetune.checks import accumulation_steps, check_config, data_parallel_ranks, is_budgeted
from finetune.schema import (
    CHOICES, OPEN_DICTS, Config, DataConfig, LogConfig, LoraConfig, ModelConfig, OptimConfig, RecipeError,
    ScheduleConfig, TrainConfig,
)

__all__ = [
    "CHOICES", "OPEN_DICTS", "Config", "DataConfig", "LogConfig", "LoraConfig", "ModelConfig", "OptimConfig",
    "RecipeError", "ScheduleConfig", "TrainConfig", "accumulation_steps", "check_config", "data_parallel_ranks",
    "is_budgeted", "load_config", "to_yaml",
]


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}{key}"
            keys.append(path)
            keys += _all_keys(node._get_node(key), path + ".")
    return keys


# transformers.TrainingArguments names people bring along, and where that setting lives in a recipe
TRAINER_NAMES = {
    "learning_rate": "optim.lr", "lr": "optim.lr", "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation is derived from it)",
    "num_train_epochs": "train.epochs", "lr_scheduler_type": "schedule.name", "optim": "optim.name",
    "bf16": "train.precision", "fp16": "train.precision", "batch_size": "train.global_batch_size",
    "model_name_or_path": "model.name_or_path", "report_to": "log.wandb_mode", "logging_steps": "log.every_steps",
    "resume_from_checkpoint": "train.resume_from", "dataset": "data.source", "max_seq_length": "data.max_length",
}


def _unknown_key_error(key: str, where: str, schema: DictConfig) -> RecipeError:
    leaf = key.rsplit(".", 1)[-1]
    trainer_name = difflib.get_close_matches(leaf, list(TRAINER_NAMES), n=1, cutoff=0.85)
    if trainer_name:
        return RecipeError(f"{where}: unknown key '{key}'; in a recipe this is {TRAINER_NAMES[trainer_name[0]]}")
    known = _all_keys(schema)
    guess = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not guess:  # a typo in the leaf only: compare with the leaves
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
        guess = [by_leaf[g] for g in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    hint = f"; did you mean '{guess[0]}'?" if guess else "; see finetune/schema.py for the keys"
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


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
