"""The run plan: every fact a checked recipe implies for a launch, computed once (`resolve_plan`) and read by every
part that builds the run. Nothing else derives them again: ranks, micro-batches per optimizer step, how training and
eval rows become micro-batches, which eval sets there are, the global batch and the peak learning rate.

`train.micro_batch_size: auto` leaves the batch unplanned (`accumulation` None); the planner (finetune/tools/plan.py)
chooses a size and the resolved recipe gets a new plan.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from finetune.recipe.batch_modes import Batching
from finetune.recipe.checks import accumulation_steps
from finetune.recipe.fields import RecipeError
from finetune.recipe.schema import Config, choice_error
from finetune.recipe.set_checks import (
    eval_batching,
    eval_set_names,
    evaluates,
    ignored_eval_keys,
    instead_of_packing,
    training_batching,
)


@dataclass(frozen=True)
class RunPlan:
    ranks: int
    accumulation: int | None  # micro-batches per rank per optimizer step; None until micro_batch_size=auto is planned
    training: Batching
    evaluation: Batching | None  # None: the recipe has no eval set
    eval_sets: tuple[str, ...]  # the named eval sets in evaluation order; () with one unnamed set
    global_batch: int  # what one optimizer step takes over all ranks, in `batch_unit`
    batch_unit: str  # sequences | tokens (train.global_batch_tokens)
    peak_lr: float  # optim.lr after optim.lr_scaling to the global batch
    run_name: str  # log.run_name, else named after the recipe file, global batch size and lr
    ignored_eval_keys: tuple[str, ...]  # eval keys given that mean nothing without an eval set (said at start)
    instead_of_packing: str  # overrides that batch the packed sets otherwise, each runs as written: the way out

    @property
    def evaluates(self) -> bool:
        return self.evaluation is not None

    @property
    def packs(self) -> bool:
        """Whether any rows the run reads are packed (per-sequence attention is worth switching to)."""
        return self.training.packs or (self.evaluation is not None and self.evaluation.packs)


def resolve_plan(config: Config, ranks: int) -> RunPlan:
    """The plan of a checked recipe launched on `ranks` processes; a RecipeError where the global batch does not
    split into micro-batches × accumulation × ranks."""
    planned = config.train.micro_batch_size != "auto"
    global_batch, unit = global_batch_of(config)
    return RunPlan(
        ranks=ranks,
        accumulation=accumulation_steps(config, ranks) if planned else None,
        training=training_batching(config),
        evaluation=eval_batching(config.eval) if evaluates(config) else None,
        eval_sets=tuple(eval_set_names(config)),
        global_batch=global_batch,
        batch_unit=unit,
        peak_lr=peak_lr(config),
        run_name=run_name(config),
        ignored_eval_keys=tuple(ignored_eval_keys(config)),
        instead_of_packing=instead_of_packing(config),
    )


def run_name(config: Config) -> str:
    """log.run_name, else `<recipe file's stem>-gb<train.global_batch_size>-lr<optim.lr>` (`run` without a file)."""
    if config.log.run_name:
        return config.log.run_name
    recipe = os.path.splitext(os.path.basename(config.recipe))[0] if config.recipe else "run"
    return f"{recipe}-gb{config.train.global_batch_size}-lr{config.optim.lr:g}"


def global_batch_of(config: Config) -> tuple[int, str]:
    """The global batch the LR scales with, and its unit: tokens under train.global_batch_tokens, else sequences."""
    if config.train.global_batch_tokens:
        return config.train.global_batch_tokens, "tokens"
    return config.train.global_batch_size, "sequences"


def peak_lr(config: Config) -> float:
    """optim.lr scaled by optim.lr_scaling from optim.base_batch_size to the run's global batch (resume compares two
    recipes' with it)."""
    o = config.optim
    return scaled_lr(o.lr, global_batch_of(config)[0], o.lr_scaling, o.base_batch_size)


def scaled_lr(lr: float, global_batch: int, rule: str, base_batch: int | None) -> float:
    """`optim.lr` after the scaling rule: × global/base (linear, Goyal et al. 2017) or × √(global/base) (sqrt)."""
    if rule == "none":
        return lr
    if not base_batch or base_batch <= 0:
        raise RecipeError(
            f"optim.lr_scaling={rule} needs a positive optim.base_batch_size (the global batch optim.lr was tuned for)"
        )
    ratio = global_batch / base_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise choice_error("optim.lr_scaling", rule)
