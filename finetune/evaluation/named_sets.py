"""Several named eval sets (eval.sets, or rows held out of each data.mixture source) evaluated as one evaluation:
each set's exact figures as `eval_<name>_*`, the token mean over all their tokens as `eval_loss` (what the best model
and early stopping follow unless eval.metric names another), one log line and one `on_evaluate` for all of them.
`transformers.Trainer` evaluates a dict of datasets one by one, logs each on its own line and has no `eval_loss`."""

from __future__ import annotations

import time

from transformers.trainer_utils import speed_metrics

from finetune.core import token_mean


def evaluate_sets(trainer, datasets: dict, ignore_keys=None, prefix: str = "eval") -> dict[str, float]:
    """What `trainer.evaluate()` returns for the recipe's named eval sets (`datasets`: {name: dataset}); the trainer
    logs them and calls on_evaluate once (RecipeTrainer.evaluate)."""
    started = time.time()
    metrics: dict[str, float] = {}
    samples = 0
    for name, dataset in datasets.items():
        output = trainer.evaluation_loop(
            trainer.get_eval_dataloader(dataset),
            description=f"Evaluation ({name})",
            prediction_loss_only=True if trainer.compute_metrics is None else None,
            ignore_keys=ignore_keys,
            metric_key_prefix=f"{prefix}_{name}",
        )
        metrics.update(output.metrics)
        samples += output.num_samples
    metrics.update(token_mean.combined_metrics(metrics, list(datasets), prefix))
    metrics.update(speed_metrics(prefix, started, num_samples=samples, num_steps=samples))
    return metrics
