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


def check_batching(batching: Batching, max_length: int, streaming: bool = False, with_budget: tuple = ()) -> None:
    """One set's batching keys (data.* for training, eval.* for the eval set) against the modes' table. `with_budget`:
    the other overrides a token budget of this set needs (training's: `budget_keys`)."""
    key, mode, budget = batching.section, batching.mode, batching.max_tokens
    if streaming and batching.needs_lengths_up_front:
        way = f"{key}.batching=padded or {key}.batching=packed"
        if batching.budgeted:  # the budget's keys go too: the global batch is counted in sequences again
            way = f"batch the stream padded or packed without {key}.max_tokens_per_micro_batch and its global batch"
        raise RecipeError(
            f"{key}.batching={mode} sorts or budgets rows by length, which a stream does not know up "
            f"front; set data.streaming=false, or {way}"
        )
    if MODES[mode].budget == "required" and not budget:
        unit = "tokens per eval micro-batch" if key == "eval" else "tokens per micro-batch"
        rows = batching.rows_per_micro_batch
        if not isinstance(rows, int):  # train.micro_batch_size=auto: refused with a budget (checks.py)
            raise RecipeError(f"{key}.batching={mode} needs {key}.max_tokens_per_micro_batch ({unit})")
        keys = " ".join([f"{key}.max_tokens_per_micro_batch={rows * max_length}", *with_budget])
        raise RecipeError(
            f"{key}.batching={mode} needs {key}.max_tokens_per_micro_batch ({unit}); set {keys} ({rows} rows of "
            "data.max_length)"
        )
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


def instead_of_packing(config: Config) -> str:
    """How each packed set (training; eval where there is one) is batched without packing, as alternatives of
    overrides that each run as written ("" where nothing packs): a token budget with every key it needs given a
    value, or padded rows where that alone runs."""
    sets = [training_unpacked(config)] if MODES[config.data.batching].packs else []
    if evaluates(config) and MODES[config.eval.batching].packs:
        sets.append(eval_unpacked(config.eval, config.data.max_length))
    budgeted = [o for budget, padded in sets for o in budget or padded]
    padded = [o for budget, padded in sets for o in padded or budget]
    ways = " or ".join(" ".join(way) for way in ([budgeted, padded] if padded != budgeted else [budgeted]) if way)
    if "=token_budget" in ways:
        ways += " (token_budget: rows of similar length batched to a budget, most of packing's speed, each row alone)"
    return ways


def training_unpacked(config: Config) -> tuple[list[str], list[str]]:
    """(the overrides that batch packed training rows to a token budget, those that pad them) where each runs alone,
    else []. The budget is the one set, else the micro-batch's rows × data.max_length. A stream cannot be budgeted
    (its lengths come late)."""
    data, train = config.data, config.train
    if data.streaming:
        return [], ["data.batching=padded"]
    if data.max_tokens_per_micro_batch:  # packed to a budget: train.global_batch_tokens is set too
        return ["data.batching=token_budget"], []
    rows = train.micro_batch_size if isinstance(train.micro_batch_size, int) else 1  # auto: resolved before a refusal
    budget = f"data.max_tokens_per_micro_batch={rows * data.max_length}"
    return ["data.batching=token_budget", budget, *global_batch_in_tokens(config)], ["data.batching=padded"]


def global_batch_in_tokens(config: Config) -> list[str]:
    """The overrides that count a training global batch in tokens, where it is counted in sequences ([] where it is
    not): train.global_batch_tokens = train.global_batch_size × data.max_length (the same micro-batches per step at
    a budget of the micro-batch's rows × data.max_length), and optim.base_batch_size scaled alike where
    optim.lr_scaling reads it, so that the peak lr stays."""
    train, optim, length = config.train, config.optim, config.data.max_length
    if train.global_batch_tokens:
        return []
    keys = [f"train.global_batch_tokens={train.global_batch_size * length}"]
    if optim.lr_scaling != "none" and optim.base_batch_size:
        keys.append(f"optim.base_batch_size={optim.base_batch_size * length}")
    return keys


def eval_unpacked(ev: EvalConfig, max_length: int) -> tuple[list[str], list[str]]:
    """As `training_unpacked`, for packed eval rows: the budget set, else eval's micro-batch rows × data.max_length."""
    if ev.max_tokens_per_micro_batch:
        return ["eval.batching=token_budget"], []
    budget = f"eval.max_tokens_per_micro_batch={ev.micro_batch_size * max_length}"
    return ["eval.batching=token_budget", budget], ["eval.batching=padded"]


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
