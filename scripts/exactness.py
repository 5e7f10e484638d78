"""The exactness table of the README: applied gradient vs the float64 per-sequence reference, ours and Trainer's.

    OMP_NUM_THREADS=2 python scripts/exactness.py

For each model (a tiny Llama, a tiny Qwen2.5-VL with `accepts_loss_kwargs = False`, a plain nn.Module returning a
per-batch mean loss) and each (micro-batch, accumulation) case, trains with SGD lr 1 (the parameter change is the
applied gradient) and prints the largest relative error over the run's optimizer steps.
"""

import copy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Trainer  # noqa: E402

from finetune import TokenNormTrainer  # noqa: E402
from tests.test_trainer import MODELS, step_errors, train_recording  # noqa: E402
from tests.toy import ragged_rows  # noqa: E402

CASES = {"micro 8 × acc 1": (8, 1, 16), "micro 1 × acc 8": (1, 8, 16), "uneven micro-batches": (4, 3, 10),
         "partial final window": (2, 4, 10)}


def worst_error(trainer_cls, model_name, micro, accumulation, rows) -> float:
    initial = MODELS[model_name]()
    with tempfile.TemporaryDirectory() as out:
        _, windows, snapshots = train_recording(
            trainer_cls, copy.deepcopy(initial), ragged_rows(rows, seed=rows + micro), Path(out), micro, accumulation
        )
    return max(error for error, _ in step_errors(initial, windows, snapshots))


def main() -> None:
    print("| model | case | TokenNormTrainer | transformers.Trainer |\n|---|---|---|---|")
    for model_name in MODELS:
        for case, (micro, accumulation, rows) in CASES.items():
            ours = worst_error(TokenNormTrainer, model_name, micro, accumulation, rows)
            stock = worst_error(Trainer, model_name, micro, accumulation, rows)
            print(f"| {model_name} | {case} | {ours:.1e} | {stock:.1e} |", flush=True)


if __name__ == "__main__":
    main()
