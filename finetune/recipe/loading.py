"""`load_config(argv)`: a recipe and its `key=value` overrides onto the schema, checked; the `key=value` splitter.

YAML, then `key=value` overrides, merge onto the schema (finetune/recipe/schema.py) in OmegaConf struct mode, so an
unknown key or a value of the wrong type is an error at load time; then the cross-field checks
(finetune/recipe/checks.py), in the user's key names. `recipe=NAME` is a path, or else a built-in recipe's name
(`recipe=vlm.yaml`, `recipe=quickstart`: the repository's recipes/ folder); a path that exists wins.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from finetune.recipe.checks import check_config
from finetune.recipe.fields import RecipeError, first_line
from finetune.recipe.schema import OPEN_DICTS, Config
from finetune.recipe.yaml_reader import parse_yaml, read_yaml_file

BUILT_IN_RECIPES = Path(__file__).resolve().parents[2] / "recipes"  # beside the package in a clone (editable install)


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}{key}"
            keys.append(path)
            keys += _all_keys(node._get_node(key), path + ".")
    return keys


# Names people bring from transformers.TrainingArguments, TRL, axolotl and LLaMA-Factory: where that setting lives in
# a recipe, or what this project does instead
TRAINER_NAMES = {
    "learning_rate": "optim.lr",
    "lr": "optim.lr",
    "per_device_train_batch_size": "train.micro_batch_size",
    "per_device_eval_batch_size": "eval.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation is derived from it)",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "lr_scheduler_type": "schedule.name",
    "lr_scheduler": "schedule.name",
    "warmup_steps": "schedule.warmup_steps",
    "warmup_ratio": "schedule.warmup_ratio",
    "weight_decay": "optim.weight_decay",
    "optim": "optim.name",
    "optimizer": "optim.name",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "batch_size": "train.global_batch_size",
    "model_name_or_path": "model.name_or_path",
    "base_model": "model.name_or_path",
    "report_to": "log.wandb_mode",
    "logging_steps": "log.every_steps",
    "resume_from_checkpoint": "train.resume_from",
    "dataset": "data.source",
    "datasets": "data.source (several: data.mixture)",
    "max_seq_length": "data.max_length",
    "sequence_len": "data.max_length",
    "cutoff_len": "data.max_length",
    "template": "data.chat_template",
    "packing": "data.batching=packed",
    "sample_packing": "data.batching=packed",
    "eval_steps": "eval.every_steps",
    "eval_strategy": "eval.every_steps",
    "evaluation_strategy": "eval.every_steps",
    "load_best_model_at_end": "eval.best_checkpoint",
    "val_set_size": "eval.fraction",
    "lora_r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    "lora_target": "model.lora.target_modules",
    "adapter": "model.lora.enabled",
    "finetuning_type": "model.lora.enabled",
}
# ...and those that are not a recipe key at all
NOT_RECIPE_KEYS = {
    "push_to_hub": "a run does not upload; upload train.output_dir afterwards (huggingface-cli upload)",
    "hub_model_id": "a run does not upload; upload train.output_dir afterwards (huggingface-cli upload)",
    "deepspeed": "DeepSpeed is chosen at launch: accelerate launch --config_file accelerate_configs/zero2.yaml "
    "(or zero3.yaml)",
    "fsdp": "FSDP is chosen at launch: accelerate launch --config_file accelerate_configs/fsdp2.yaml",
    "local_rank": "ranks come from the launcher (accelerate launch, torchrun)",
}


def _unknown_key_error(key: str, where: str, schema: DictConfig) -> RecipeError:
    """One line for a key the schema does not have: the recipe key a well-known name means, a key spelt closely
    (only close ones: a far guess misleads), or where the keys are listed."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf in NOT_RECIPE_KEYS:
        return RecipeError(f"{where}: unknown key '{key}'; {NOT_RECIPE_KEYS[leaf]}")
    trainer_name = difflib.get_close_matches(leaf, list(TRAINER_NAMES), n=1, cutoff=0.85)
    if trainer_name:
        return RecipeError(f"{where}: unknown key '{key}'; in a recipe this is {TRAINER_NAMES[trainer_name[0]]}")
    known = _all_keys(schema)
    guess = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if not guess:  # a typo in the leaf only: compare with the leaves
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
        guess = [by_leaf[g] for g in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)]
    hint = f"; did you mean '{guess[0]}'?" if guess else "; --help lists the keys"
    return RecipeError(f"{where}: unknown key '{key}'{hint}")


def _merge(schema: DictConfig, other: DictConfig, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(schema, other)
    except (ConfigAttributeError, ConfigKeyError) as e:
        key = e.full_key or str(e.key)
        raise _unknown_key_error(key, where, schema) from None
    except ValidationError as e:
        section = None if e.full_key else _section_given_a_value(schema, other)
        if section:  # OmegaConf names no key then
            keys = list(OmegaConf.select(schema, section).keys())
            raise RecipeError(
                f"{where}: {section} is a section ({', '.join(keys[:3])}, …), not a value; set its keys, "
                f"e.g. {section}.{keys[0]}=…"
            ) from None
        raise RecipeError(f"{where}: {e.full_key}={e.value!r} is not a valid {_type_name(e)}; fix the value") from None
    except OmegaConfBaseException as e:
        raise RecipeError(f"{where}: {first_line(e)}") from None


def _section_given_a_value(schema: DictConfig, other: Any, prefix: str = "") -> str | None:
    """The first section of the schema that `other` sets to a plain value (`optim: 3`)."""
    if not isinstance(other, DictConfig):
        return None
    for key in other.keys():
        mine = schema._get_node(key) if key in schema else None
        if isinstance(mine, DictConfig):
            theirs = other._get_node(key)
            if not isinstance(theirs, DictConfig):
                return f"{prefix}{key}"
            if found := _section_given_a_value(mine, theirs, f"{prefix}{key}."):
                return found
    return None


def _type_name(e: ValidationError) -> str:
    msg = first_line(e)
    for word in ("Integer", "Float", "Boolean", "String"):
        if word in msg:
            names = {"Integer": "integer", "Float": "number", "Boolean": "boolean (true/false)", "String": "string"}
            return names[word]
    return "value for this key"


def recipe_file(name: str) -> Path:
    """The file `recipe=NAME` means: NAME where it is a file, else a built-in recipe (`vlm.yaml` or `vlm`)."""
    if not name.strip():
        raise RecipeError("recipe= is empty; pass recipe=PATH to a YAML file (see recipes/)")
    given = Path(name)
    if given.is_file():
        return given
    if given.is_dir():
        raise RecipeError(f"recipe={name} is a folder; pass one YAML file (e.g. recipe=recipes/debug.yaml)")
    if given.name == name:  # a bare name, no folder: a built-in recipe
        for candidate in (BUILT_IN_RECIPES / name, BUILT_IN_RECIPES / f"{name}.yaml"):
            if candidate.is_file():
                return candidate
    built_in = ", ".join(sorted(p.stem for p in BUILT_IN_RECIPES.glob("*.yaml")))
    raise RecipeError(
        f"recipe file '{name}' not found; pass recipe=PATH to an existing YAML file, or a built-in recipe: {built_in}"
    )


def _read_recipe(file: Path) -> dict:
    path = str(file)
    data = read_yaml_file(file)  # safe: a recipe can never construct Python objects; no key twice; aliases bounded
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections (model:, data:, train:, …)")
    return data


def split_tool_args(argv: list[str], tool: str, options: dict[str, Callable[[str], Any]]) -> tuple[list[str], dict]:
    """(the recipe's arguments, {option: value}): `TOOL.NAME=VALUE` arguments are a tool's own (`plan.headroom=0.2`,
    `verify.steps=2`), each parsed by `options[NAME]`; every other argument is the recipe's."""
    rest, found = [], {}
    for arg in argv:
        key, _, value = arg.partition("=")
        key = key.strip()
        if not key.startswith(f"{tool}."):
            rest.append(arg)
            continue
        name = key.removeprefix(f"{tool}.")
        if name not in options:
            names = [f"{tool}.{option}" for option in options]
            raise RecipeError(f"unknown key '{key}'; {tool} takes {', '.join(names[:-1])} and {names[-1]}")
        try:
            found[name] = options[name](value)
        except ValueError:
            raise RecipeError(f"{key}={value!r} is not a number") from None
    return rest, found


def _parse_override(arg: str) -> tuple[str, Any]:
    key, equals, value = arg.partition("=")
    if not equals:
        raise RecipeError(f"argument '{arg}' is not key=value; write e.g. optim.lr=1e-5 or recipe=recipes/debug.yaml")
    try:
        parsed = parse_yaml(value, f"command line: {key.strip()}") if value != "" else ""
    except RecipeError as e:
        if "not valid YAML" not in str(e):
            raise  # a key twice, or aliases that expand too far
        parsed = value  # not YAML: the text itself (a path with a colon, …)
    return key.strip(), parsed


class LoraKeysGiven:
    """The `model.lora.*` keys the recipe file and the overrides write, whatever their values (a key given equal to
    its default counts: it says LoRA was meant). An override `model.lora.enabled=false` turns off the keys the recipe
    file gave (a LoRA recipe trained in full on purpose); keys given on the command line always count."""

    def __init__(self):
        self.in_file: list[str] = []
        self.overridden: list[str] = []

    def add(self, layer: DictConfig, merged: DictConfig, from_file: bool) -> None:
        lora = OmegaConf.select(layer, "model.lora", default=None)
        written = [str(k) for k in lora.keys()] if isinstance(lora, DictConfig) else []
        if not from_file and "enabled" in written and not merged.model.lora.enabled:
            self.in_file = []
        given = self.in_file if from_file else self.overridden
        given += [k for k in written if k != "enabled" and k not in given]

    def check(self, config: Config) -> None:
        """A LoRA key without `model.lora.enabled=true` would silently train the full model: an error."""
        keys = self.in_file + [k for k in self.overridden if k not in self.in_file]
        if config.model.lora.enabled or not keys:
            return
        values = {k: getattr(config.model.lora, k) for k in keys}
        given = ", ".join(f"model.lora.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
        raise RecipeError(
            f"{given} given but model.lora.enabled is false, so the full model would train; set "
            f"model.lora.enabled=true to train a LoRA adapter, or remove {', '.join(f'model.lora.{k}' for k in keys)}"
        )


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
    cfg, lora = schema, LoraKeysGiven()
    if recipes:
        path = str(recipe_file(str(recipes[0])))
        layer = OmegaConf.create(_read_recipe(Path(path)))
        cfg = _merge(cfg, layer, path)
        lora.add(layer, cfg, from_file=True)
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
        lora.add(dotted, cfg, from_file=False)
    missing = sorted(k for k in OmegaConf.missing_keys(cfg))
    if missing:
        raise RecipeError(f"{', '.join(missing)} must be set; add it to the recipe or pass {missing[0]}=…")
    config: Config = OmegaConf.to_object(cfg)
    check_config(config)
    lora.check(config)
    return config


def to_tree(config: Config) -> dict:
    """The resolved recipe as a tree of plain values (W&B's run config)."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def to_yaml(config: Config) -> str:
    """The recipe as YAML that load_config reads back to the same Config (recipe.yaml of a run, --dry-run)."""
    tree = OmegaConf.to_container(OmegaConf.structured(config))
    if not config.model.lora.enabled:  # its other keys are not in effect, and given without enabled they are refused
        tree["model"]["lora"] = {"enabled": False}
    return OmegaConf.to_yaml(tree)
