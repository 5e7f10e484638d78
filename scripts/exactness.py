"""The exactness table of docs/exactness.md: applied gradient vs the float64 per-sequence reference, ours and Trainer's.

    OMP_NUM_THREADS=2 python scripts/exactness.py

For each model (a tiny Llama, a tiny Qwen2.5-VL with `accepts_loss_kwargs = False`, a plain nn.Module returning a
per-batch mean loss) and each (micro-batch, accumulation) case, trains with SGD lr 1 (the parameter change is the
applied gradient) and prints the largest relative error over the run's optimizer steps.

The tiny models, the ragged rows, the recording harness (finetune/testing/toy.py) and the float64 brute force
(finetune/testing/reference.py) are the ones the tests use.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from transformers import Trainer

from finetune import TokenNormTrainer
from finetune.testing.reference import reference_gradient
from finetune.testing.toy import (
    MeanLossLM,
    RecordingCollator,
    ragged_rows,
    sgd_args,
    step_errors,
    tiny_llama,
    tiny_qwen_vl,
    train_recording,
)

CASES = {
    "micro 8 × acc 1": (8, 1, 16),
    "micro 1 × acc 8": (1, 8, 16),
    "uneven micro-batches": (4, 3, 10),
    "partial final window": (2, 4, 10),
}

MODELS = {"llama": tiny_llama, "qwen2_5_vl": tiny_qwen_vl, "mean_loss_module": MeanLossLM}


def worst_error(trainer_cls, model_name, micro, accumulation, rows) -> float:
    initial = MODELS[model_name]()
    with tempfile.TemporaryDirectory() as out:
        _, windows, snapshots = train_recording(
            trainer_cls, copy.deepcopy(initial), ragged_rows(rows, seed=rows + micro), Path(out), micro, accumulation
        )
    return max(error for error, _ in step_errors(initial, windows, snapshots))


EVAL_BATCHES = (1, 3, 7, 16)


def eval_errors(trainer_cls, model_name) -> list[float]:
    """Relative error of `evaluate()["eval_loss"]` against the float64 token mean of the whole eval set (23 rows of
    4–48 tokens), at each eval batch size."""
    model, rows = MODELS[model_name](), ragged_rows(23, seed=9, min_len=4, max_len=48)
    _, reference = reference_gradient(model, rows)
    errors = []
    for batch in EVAL_BATCHES:
        with tempfile.TemporaryDirectory() as out:
            args = sgd_args(Path(out), 1, 1)
            args.per_device_eval_batch_size = batch
            trainer = trainer_cls(model=model, args=args, eval_dataset=rows, data_collator=RecordingCollator())
            errors.append(abs(trainer.evaluate()["eval_loss"] - reference) / reference)
    return errors


def main() -> None:
    print("| model | case | TokenNormTrainer | transformers.Trainer |\n|---|---|---|---|")
    for model_name in MODELS:
        for case, (micro, accumulation, rows) in CASES.items():
            ours = worst_error(TokenNormTrainer, model_name, micro, accumulation, rows)
            stock = worst_error(Trainer, model_name, micro, accumulation, rows)
            print(f"| {model_name} | {case} | {ours:.1e} | {stock:.1e} |", flush=True)
    print(
        f"\n| model | eval_loss at eval batch {' / '.join(map(str, EVAL_BATCHES))} | TokenNormTrainer | "
        "transformers.Trainer |\n|---|---|---|---|"
    )
    for model_name in ("llama", "mean_loss_module"):
        ours, stock = (
            " / ".join(f"{e:.1e}" for e in eval_errors(cls, model_name)) for cls in (TokenNormTrainer, Trainer)
        )
        print(f"| {model_name} | relative error vs the float64 token mean | {ours} | {stock} |", flush=True)


if __name__ == "__main__":
    main()
