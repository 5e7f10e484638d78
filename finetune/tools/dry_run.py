"""`finetune-train --dry-run recipe=… [key=value …]`: the resolved recipe and its plan, without training.

Prints the recipe as YAML (after the recipe file and the overrides; every key, defaults included), then the plan as
`#` comments, so the whole output is itself a recipe (`> run.yaml`, then `recipe=run.yaml`). The plan is what
`finetune.assemble.build` derives, by the same functions: the effective batch (micro-batch × accumulation × ranks)
and learning rate (`schedules.startup_line`), the optimizer steps (`batching.count_optimizer_steps`), the warmup
(`schedules.warmup_steps`), the schedule and the precision. No model weights are loaded and nothing is written.
The step count needs the data only when the run is counted in epochs (train.max_steps=-1): then the tokenizer and
the training rows load as training loads them (their report lines go to stderr, keeping stdout a recipe).
`train.micro_batch_size: auto` is planned with memory trials on the model: the plan then shows what is known
without it (finetune-plan shows the choice). Last, the first rows of data.source as they will train (`FIRST_ROWS`,
read, rendered and labelled as training does them), their targets between ⟦ and ⟧.
"""

from __future__ import annotations

import contextlib
import sys

from finetune.env import is_main_process
from finetune.recipe import Config, RunPlan, to_yaml
from finetune.recipe.usage import print_page

FIRST_ROWS = 2


def optimizer_steps(cfg: Config, plan: RunPlan) -> tuple[int, str]:
    """(the run's optimizer steps, where the number comes from), counted as `build` counts them."""
    from finetune.data import batching

    if cfg.train.max_steps > 0:
        return cfg.train.max_steps, "train.max_steps"
    from finetune.assemble import load_data, load_tokenizer

    with contextlib.redirect_stdout(sys.stderr):  # the data report lines
        _, rows, tokenizer = load_tokenizer(cfg.model, cfg.data, cfg.train, plan)
        batches = load_data(cfg.data, cfg.eval, cfg.train.seed, plan, tokenizer, rows, evaluate=False).batches
    steps = batching.count_optimizer_steps(cfg.train, batches, plan.ranks, plan.accumulation)
    return steps, f"train.epochs={cfg.train.epochs:g}, counted from the data"


def plan_lines(cfg: Config, plan: RunPlan) -> list[str]:
    """The plan: batch and lr, optimizer steps, warmup and schedule, precision."""
    from finetune.training import schedules

    s = cfg.schedule
    ranks = plan.ranks
    precision = f"precision {cfg.train.precision} (weights loaded in {cfg.model.dtype})"
    if plan.accumulation is None:  # train.micro_batch_size=auto
        return [
            f"effective batch {plan.global_batch} {plan.batch_unit} = micro auto × accumulation (planned when "
            "training starts; finetune-plan shows the choice) × "
            f"{ranks} rank{'s' if ranks != 1 else ''}; lr {schedules.format_lr(plan.peak_lr)}",
            f"schedule {s.name}",
            precision,
        ]
    steps, source = optimizer_steps(cfg, plan)
    schedules.check_schedule(steps, s)  # as build checks it: a warmup as long as the run is an error here too
    if s.name == "onecycle":
        shape = f"schedule onecycle (pct_start {s.pct_start:g}, div_factor {s.div_factor:g}, anneal {s.anneal})"
    else:
        warmup = schedules.warmup_steps(steps, s)
        shape = f"warmup {warmup} optimizer step{'s' if warmup != 1 else ''} ({s.warmup}); schedule {s.name}"
        shape += f" down to min_lr_ratio {s.min_lr_ratio:g}" if s.name != "constant" else ""
    return [
        schedules.startup_line(cfg.train, cfg.data, cfg.optim, plan, steps) + f" ({source})",
        shape,
        precision,
    ]


def row_lines(cfg: Config, plan: RunPlan) -> list[str]:
    """The first rows of data.source as they will train, targets marked (image rows and mixtures: a line saying
    they are not shown)."""
    import dataclasses

    from finetune.assemble import load_tokenizer
    from finetune.data.chat_labels import marked
    from finetune.data.text import load_sft_dataset

    if cfg.data.mixture:
        return ["rows: not shown for data.mixture (each source's first rows: --dry-run data.source=SOURCE)"]
    with contextlib.redirect_stdout(sys.stderr):
        _, rows, tokenizer = load_tokenizer(cfg.model, cfg.data, cfg.train, plan)
        if rows.images:
            return ["rows: image rows are not shown"]
        first = dataclasses.replace(cfg.data, limit=FIRST_ROWS, streaming=False, on_bad_row="skip")
        dataset, _ = load_sft_dataset(first, tokenizer)
    lines = [f"first {len(dataset)} rows of {cfg.data.source} as they train (targets between ⟦ and ⟧):"]
    for k, row in enumerate(dataset, 1):
        lines += [f"row {k}:", *marked(tokenizer, row["input_ids"], row["labels"]).splitlines()]
    return lines


def dry_run(cfg: Config, plan: RunPlan) -> int:
    """Print the recipe, its plan and its first rows on the main process; exit code 0."""
    lines = plan_lines(cfg, plan)
    rows = row_lines(cfg, plan)
    if is_main_process():
        page = [
            f"# resolved recipe ({cfg.recipe or 'no recipe file'} + command line)",
            to_yaml(cfg).rstrip("\n"),
            "# plan (--dry-run: nothing trained, no model weights loaded)",
            *(f"#   {line}" for line in lines),
            *(f"# {line}" for line in rows),
        ]
        print_page("\n".join(page))
    return 0
