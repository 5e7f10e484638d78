"""Evaluation in a recipe run: when, what is logged, the best model and early stopping, the end-of-run figures.

When: before the first step (the Trainer's `eval_on_start`, on a fresh start only: a resumed run's log history holds
that evaluation already), every `eval.every_steps` optimizer steps (`eval_strategy="steps"`) and after the last step
(`EvaluateAtEnd`). The eval loss is `TokenNormTrainer.evaluate()`'s exact token mean of the whole eval set; its
micro-batches come through the Trainer's own evaluation loop with the eval set's collator (RecipeTrainer).

Logged per evaluation: `eval_loss`, `eval_perplexity` (exp of the loss), `eval_label_tokens` (all of them in
trainer_state.json's log history, which a resumed run reproduces) and `eval_tokens_per_s` (real tokens of the eval set
÷ its wall time), which like the Trainer's eval runtime figures reaches the console and W&B but not the log history.

Best model (`eval.best_checkpoint`) and early stopping (`eval.early_stopping_patience`) use the Trainer's own
`metric_for_best_model="eval_loss"`: the lowest eval loss after a training step and its step are TrainerState's
`best_metric` and `best_global_step` (saved in every checkpoint's trainer_state.json, so a resumed run continues from
them); the model of a new best is written to `train.output_dir/best` by finetune/training/best_model.py. Early
stopping is transformers' EarlyStoppingCallback, whose counter is restored from the checkpoint on resume
(`restore_callback_states_from_checkpoint`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import EarlyStoppingCallback, TrainerCallback

from finetune.recipe import EvalConfig

if TYPE_CHECKING:
    from finetune.evaluation.samples import GenerateSamples

BEST = "best"  # train.output_dir/best: the model of the lowest eval loss (eval.best_checkpoint)
# measured, not reproducible: to the console and W&B, not to trainer_state.json (as meter.TIMING_KEYS for steps)
EVAL_TIMING_KEYS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_tokens_per_s")
EVAL_FIELDS = [  # (log key, label, format) of the console line per evaluation
    ("eval_loss", "loss", "{:.4f}"),
    ("eval_perplexity", "ppl", "{:.2f}"),
    ("eval_token_accuracy", "acc", "{:.4f}"),
    ("eval_label_tokens", "targets", "{:,.0f}"),
    ("eval_tokens_per_s", "tok/s", "{:.0f}"),
]


@dataclass
class EvalSetup:
    collator: Callable  # the eval set's (eval.batching), for the Trainer's evaluation loop
    tokens: int  # real tokens of the eval set: eval tokens/s
    keep_best: bool  # eval.best_checkpoint


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class EarlyStopping(EarlyStoppingCallback):
    """transformers' EarlyStoppingCallback, without its start-up warning that the best model is not loaded at the end:
    a recipe keeps it in output_dir/best instead (eval.best_checkpoint)."""

    def on_train_begin(self, args, state, control, **kwargs):
        pass  # metric_for_best_model and eval_strategy are set by arguments.eval_keys whenever this callback is added


class EvaluateAtEnd(TrainerCallback):
    """An evaluation after the last optimizer step, whether or not eval.every_steps divides the run."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_evaluate = True


@dataclass
class EvalCallbacks:
    """What an evaluating recipe adds to the Trainer's callbacks (`callbacks`), and by name those others read: the
    sample generator (the planner's KV-cache estimate) and early stopping (the end-of-run figures)."""

    callbacks: list[TrainerCallback]
    samples: GenerateSamples | None
    early_stopping: EarlyStopping | None


def callbacks(ev: EvalConfig, prompts: list) -> EvalCallbacks:
    """`prompts`: finetune.evaluation.prompts.SamplePrompt, generated from at each evaluation."""
    from finetune.evaluation.samples import GenerateSamples

    at_end = EvaluateAtEnd()
    samples = GenerateSamples(prompts, ev.max_new_tokens) if prompts else None
    patience = ev.early_stopping_patience
    early_stopping = EarlyStopping(patience) if patience else None
    added = [at_end, *(c for c in (samples, early_stopping) if c is not None)]
    return EvalCallbacks(added, samples, early_stopping)


def eval_line(logs: dict, step: int, max_steps: int) -> str:
    """The console line of one evaluation: the whole (all sets') figures, then each named set's."""
    fields = [f"{label} {fmt.format(logs[key])}" for key, label, fmt in EVAL_FIELDS if logs.get(key) is not None]
    for key in [k for k in logs if k.startswith("eval_") and k.endswith("_loss") and k != "eval_loss"]:
        name = key.removeprefix("eval_").removesuffix("_loss")
        fields.append(f"| {name} loss {logs[key]:.4f} ppl {perplexity(logs[key]):.2f}")
    return f"eval at step {step}/{max_steps}  " + "  ".join(fields)


# ---- the end-of-run figures ----


def summary(trainer) -> dict:
    """First and last evaluation, the lowest eval loss and its step, the best model's folder, early stopping."""
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    lowest = min(evals, key=lambda e: e["eval_loss"])
    figures = {
        "eval_loss_first": first["eval_loss"],
        "eval_first_step": first["step"],
        "eval_loss": last["eval_loss"],
        "eval_step": last["step"],
        "eval_perplexity": perplexity(last["eval_loss"]),
        "eval_label_tokens": last.get("eval_label_tokens"),
        "evaluations": len(evals),
        "eval_tokens_per_s": trainer.eval_speeds[-1] if getattr(trainer, "eval_speeds", None) else None,
        "eval_loss_lowest": lowest["eval_loss"],
        "eval_lowest_step": lowest["step"],
    }
    setup = getattr(trainer, "eval_setup", None)
    best = os.path.join(trainer.args.output_dir, BEST)
    if setup is not None and setup.keep_best and trainer.state.best_global_step and os.path.isdir(best):
        figures.update(
            best_step=trainer.state.best_global_step,
            best_eval_loss=trainer.state.best_metric,
            best_model=os.path.abspath(best),
        )
    evaluating = getattr(trainer, "eval_callbacks", None)
    stopper = evaluating.early_stopping if evaluating is not None else None
    if stopper is not None and stopper.early_stopping_patience_counter >= stopper.early_stopping_patience:
        figures["stopped_early_at"] = trainer.state.global_step
    return figures


def summary_rows(figures: dict) -> list[tuple[str, str]]:
    """Rows of the end-of-run table, from `summary`'s figures."""
    if "eval_loss" not in figures:
        return []
    first, last = figures["eval_loss_first"], figures["eval_loss"]
    change = f", {(last - first) / first:+.1%}" if first else ""
    rows = [
        (
            "eval loss",
            f"{first:.4f} at step {figures['eval_first_step']} → {last:.4f} at step "
            f"{figures['eval_step']}{change} ({figures['evaluations']} evaluations)",
        ),
        ("eval perplexity", f"{figures['eval_perplexity']:.2f}"),
        (
            "eval targets",
            f"{figures['eval_label_tokens'] or 0:,}"
            + (f" at {figures['eval_tokens_per_s']:.0f} tokens/s" if figures["eval_tokens_per_s"] else ""),
        ),
    ]
    if "best_model" in figures:
        rows.append(
            (
                "best model",
                f"step {figures['best_step']} (eval loss {figures['best_eval_loss']:.4f}): {figures['best_model']}",
            )
        )
    else:
        rows.append(("lowest eval loss", f"{figures['eval_loss_lowest']:.4f} at step {figures['eval_lowest_step']}"))
    if "stopped_early_at" in figures:
        rows.append(("stopped early", f"at step {figures['stopped_early_at']} (eval.early_stopping_patience)"))
    return rows
