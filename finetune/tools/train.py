"""Train a recipe: what `finetune/train.py` (and the `finetune-train` console script) runs.

    accelerate launch finetune/train.py recipe=recipes/quickstart.yaml optim.lr=1e-5
    python finetune/train.py recipe=debug train.max_steps=3

Top to bottom: recipe → launch settings → output folder → micro-batch size (`auto`: planned on this machine,
finetune/tools/plan.py) → the trainer (`finetune.assemble.build`) → resume → train → save → end-of-run table.
Nothing heavy is imported before the recipe is known good: a typo fails in a second, before torch loads.
"""

from __future__ import annotations

import sys

from finetune.env import cpu_threads, report_stop_code, world_size
from finetune.recipe import Config, RunPlan, load_config, resolve_plan, to_yaml
from finetune.recipe.usage import Command, help_asked, print_page
from finetune.tools.boundary import run_command
from finetune.training import distributed

DRY_RUN = "--dry-run"
COMMAND = Command(
    "finetune-train",
    "Train a recipe: the recipe file, then each key=value override, onto the schema; checked before torch loads.",
    also=("python finetune/train.py …", "accelerate launch finetune/train.py …"),
    flags=((DRY_RUN, "print the resolved recipe (YAML) and the plan (batch, steps, warmup, precision); no training"),),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        if (text := help_asked(argv, COMMAND)) is not None:
            print_page(text)
            return 0
        cfg = load_config([arg for arg in argv if arg != DRY_RUN])
        plan = resolve_plan(cfg, world_size())
        # accelerate launch's settings vs the recipe, before torch loads
        distributed.check_launch(cfg.train, cfg.optim, cfg.data, plan)
        if DRY_RUN in argv:  # the recipe and what it implies, without loading the model
            from finetune.tools.dry_run import dry_run

            return dry_run(cfg, plan)
        return train(cfg, argv=argv, plan=plan)

    # one `error:` line for what the user can fix (exit 2; 3: stopped on a non-finite value), a traceback for a bug
    return run_command(body)


def use_cpu_threads() -> None:
    """A CPU run computes on every physical core (or on OMP_NUM_THREADS where the user chose it): `accelerate launch`
    would otherwise leave it one thread. The line says how many."""
    import torch

    from finetune.training import reporting

    if reporting.has_accelerator():
        return
    threads, why = cpu_threads()
    torch.set_num_threads(threads)
    reporting.main_print(f"cpu: {threads} thread{'s' if threads > 1 else ''} ({why})")


def train(cfg: Config, callbacks: tuple = (), argv: list[str] | None = None, plan: RunPlan | None = None) -> int:
    """Train `cfg` (planned as `plan`, default: for this launch's ranks) to the end (or to a stop request), save,
    report; the exit code. RecipeError for what the user can fix (NonFiniteError, exit code 3, when
    train.on_nonfinite=stop meets a NaN/inf)."""
    from finetune.assemble import build
    from finetune.training import checkpoints, console, lifecycle, output_dir, reporting, resume_checks, run_summary

    use_cpu_threads()
    console.plain_console()  # in a log file: no library progress bars (each redraw would be a line fragment)
    if warning := lifecycle.container_stop_warning(sys.argv[1:] if argv is None else argv):
        reporting.main_print(warning)  # the launcher is PID 1 and drops SIGTERM: a container's stop never arrives
    stop = lifecycle.StopRequest()  # SIGTERM/SIGINT: stop at the next micro-batch, save the last step, exit 128+N
    with output_dir.claimed(cfg.train.output_dir), stop.installed():  # one run per output_dir at a time
        lifecycle.check_writable(cfg.train.output_dir)  # now, not at the first save hours later
        if cfg.train.micro_batch_size == "auto":  # the largest that fits, global batch kept; recipe.yaml records it
            from finetune.tools.plan import resolve_auto_micro_batch

            cfg, plan = resolve_auto_micro_batch(cfg)
        plan = plan or resolve_plan(cfg, world_size())
        record = resume_checks.RecipeRecord(to_yaml(cfg))  # recipe.yaml in each checkpoint; compared at resume
        ends_evaluation = lifecycle.StopDuringEvaluation(stop)  # a stop request ends an evaluation at a batch
        trainer = build(
            cfg, plan, callbacks=(*callbacks, record, ends_evaluation), run_files=(record,), stop_request=stop
        )
        lifecycle.check_space(cfg.train.output_dir, trainer.model)
        resume = checkpoints.resume_path(cfg.train)  # auto: the newest complete checkpoint-N, or a fresh start
        if line := lifecycle.start_line(cfg.train, resume):
            reporting.main_print(line)
        if resume and (warning := record.resume(resume, checkpoints.checkpoint_step(resume))):
            reporting.main_print(warning)
        start_step = checkpoints.checkpoint_step(resume) if resume else 0
        trainer.train(resume_from_checkpoint=resume)
        run_summary.record_whole_run_loss(trainer, start_step)  # train_loss over the run's steps, not this process's
        if stop.requested and trainer.state.global_step < trainer.state.max_steps:
            reporting.main_print(lifecycle.stopped_message(stop, trainer, sys.argv[1:] if argv is None else argv))
            lifecycle.leave_together(trainer)
            report_stop_code(stop.exit_code)  # finetune-launch passes it on where the launcher replaces it
            return stop.exit_code  # 128 + the signal: "stopped, resume me" to a shell, a scheduler, a pod's policy

        # save: trainer_state.json has one log_history entry per logged optimizer step; each file lands whole
        texts = trainer.files_of_run()  # recipe.yaml (this recipe, after what each resume changed), timings.jsonl
        lifecycle.save_final(trainer, texts if trainer.is_world_process_zero() else {})
    figures = run_summary.summary(trainer, start_step)
    if trainer.reports.wandb is not None:
        trainer.reports.wandb.finish(figures)
    if trainer.is_world_process_zero():
        run_summary.print_summary(cfg.train, cfg.log, trainer, figures)
    lifecycle.leave_together(trainer)
    return 0
