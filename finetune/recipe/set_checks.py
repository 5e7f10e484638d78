"""The sets a recipe reads and how each is batched: training's rows (data.source or data.mixture's sources) and the
eval sets (held out, eval.source, eval.sets), their names, their `Batching` and the checks of both."""

from __future__ import annotations

import math
import re
from pathlib import Path

from finetune.recipe.batch_modes import MODES, Batching
from finetune.recipe.fields import RecipeError
from finetune.recipe.schema import CHOICES, Config, DataConfig, EvalConfig, choice_error


def training_batching(config: Config) -> Batching:
    """How training rows become micro-batches: data.batching, train.micro_batch_size, data.max_tokens_per_micro_batch
    (the recipe as loaded: resolve train.micro_batch_size=auto first)."""
    data = config.data
    return Batching(data.batching, config.train.micro_batch_size, data.max_tokens_per_micro_batch, "data")


def eval_batching(ev: EvalConfig) -> Batching:
    """How eval rows become micro-batches: eval.batching, eval.micro_batch_size, eval.max_tokens_per_micro_batch."""
    return Batching(ev.batching, ev.micro_batch_size, ev.max_tokens_per_micro_batch, "eval")


def check_batching(batching: Batching, max_length: int, streaming: bool = False) -> None:
    """One set's batching keys (data.* for training, eval.* for the eval set) against the modes' table."""
    key, mode, budget = batching.section, batching.mode, batching.max_tokens
    if streaming and batching.needs_lengths_up_front:
        raise RecipeError(
            f"{key}.batching={mode} sorts or budgets rows by length, which a stream does not know up "
            f"front; use {key}.batching=padded or packed (without {key}.max_tokens_per_micro_batch), or "
            "data.streaming=false"
        )
    if MODES[mode].budget == "required" and not budget:
        unit = "tokens per eval micro-batch" if key == "eval" else "tokens per micro-batch"
        raise RecipeError(f"{key}.batching={mode} needs {key}.max_tokens_per_micro_batch ({unit})")
    if budget and MODES[mode].budget == "no":
        raise RecipeError(
            f"{key}.max_tokens_per_micro_batch applies to {key}.batching=token_budget or packed, not "
            f"{mode}; remove it or change {key}.batching"
        )
    if budget and budget < max_length:
        raise RecipeError(
            f"{key}.max_tokens_per_micro_batch={budget} is below data.max_length={max_length}: a "
            "longest row would not fit; raise the budget or lower data.max_length"
        )


def evaluates(config: Config) -> bool:
    """The recipe has an eval set: a separate eval.source, named eval.sets, or rows held out (eval.fraction)."""
    return bool(config.eval.source) or bool(config.eval.sets) or config.eval.fraction > 0


def mixture_names(data: DataConfig) -> list[str]:
    """The names of data.mixture's sources: their own, else the file's stem (stdlib_docs, a hub id: as given)."""
    return [part.name or Path(part.source.rstrip("/")).name.split(".")[0] or part.source for part in data.mixture]


def eval_set_names(config: Config) -> list[str]:
    """The named eval sets, in the order they are evaluated: held out of each mixture source (eval.fraction), else
    out of data.source ("heldout", when eval.sets names others too), then eval.sets. Empty: one unnamed set."""
    ev = config.eval
    held = mixture_names(config.data) if config.data.mixture else (["heldout"] if ev.sets else [])
    names = (held if ev.fraction else []) + list(ev.sets)
    return names if len(names) > 1 or ev.sets else []


EVAL_ONLY_KEYS = ("every_steps", "best_checkpoint", "early_stopping_patience", "limit", "prompts", "samples")


def ignored_eval_keys(config: Config) -> list[str]:
    """Without an eval set (eval.fraction=0 and no eval.source: evaluation off), the eval keys given that then mean
    nothing: ignored with one note at start, so one key turns evaluation off."""
    if evaluates(config):
        return []
    defaults = EvalConfig()
    return [f"eval.{k}" for k in EVAL_ONLY_KEYS if getattr(config.eval, k) != getattr(defaults, k)]


def check_eval(config: Config) -> None:
    """The eval section against itself and the data section."""
    ev, data = config.eval, config.data
    if ev.source and ev.fraction:
        raise RecipeError(
            "set eval.source (a separate eval set) or eval.fraction (rows held out of data.source), not both"
        )
    if not evaluates(config):
        return
    check_eval_sets(config)
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
    check_batching(eval_batching(ev), data.max_length)


def check_mixture(data: DataConfig) -> None:
    """data.mixture: each source's weight, keys and name; one source list at a time."""
    if not data.mixture:
        return
    if data.streaming:
        raise RecipeError("data.mixture draws rows from each source read whole; set data.streaming=false")
    for k, part in enumerate(data.mixture):
        key = f"data.mixture[{k}]"
        if not isinstance(part.weight, (int, float)) or not math.isfinite(part.weight) or part.weight <= 0:
            raise RecipeError(
                f"{key}.weight={part.weight} must be positive and finite (its share of the training rows is "
                "weight / the sum of the weights)"
            )
        if not str(part.source).strip():
            raise RecipeError(f"{key}.source is empty; set it as data.source would be set")
        for field_name in ("format", "loss_on"):
            value = getattr(part, field_name)
            if value is not None and value not in CHOICES[f"data.{field_name}"]:
                raise choice_error(f"data.{field_name}", value)
    names = mixture_names(data)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RecipeError(f"data.mixture: two sources are named {twice[0]!r}; give each a distinct name")


def check_eval_sets(config: Config) -> None:
    """eval.sets' names and eval.metric against the sets there are."""
    ev = config.eval
    if ev.sets and ev.source:
        raise RecipeError("set eval.sets (named eval sets) or eval.source (one eval set), not both")
    for name, source in ev.sets.items():
        if not re.fullmatch(r"[A-Za-z0-9_]+", name) or not str(source or "").strip():
            raise RecipeError(
                f"eval.sets.{name}={source!r}: a set needs a name of letters, digits and _ and a source "
                "(as data.source)"
            )
    names = eval_set_names(config)
    metrics = ["eval_loss", "eval_token_accuracy"] + [
        f"eval_{n}_{m}" for n in names for m in ("loss", "token_accuracy")
    ]
    if ev.metric not in metrics:
        raise RecipeError(f"eval.metric={ev.metric} is not one of {', '.join(metrics)}")
