"""The GRPO exactness table of docs/rl.md: each optimizer step's applied gradient against the float64 gradient of its
window's objective, GRPOTrainer (TRL) and TokenNormGRPOTrainer, on the tiny policy of finetune/rl/grpo_toy.py.

    OMP_NUM_THREADS=1 python scripts/grpo_exactness.py [--loss-types dapo,bnpo] [--steps 2]

Accumulation 2, micro-batches of 4 completions (≤ 8 tokens), SGD; for each loss type, steps_per_generation (= the
accumulation, 2×, ½×), num_iterations (1, 2), beta (0, 0.04), and the entropy bonus (coefficient 0.05), it prints
the largest relative error over the run's optimizer steps.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import logging
import tempfile
from pathlib import Path

import trl
from transformers.utils import logging as hf_logging

from finetune import TokenNormGRPOTrainer
from finetune.rl.grpo_toy import sgd_config, step_errors, tiny_policy_folder, train_grpo

LOSS_TYPES = ("dapo", "bnpo", "cispo", "grpo", "sapo", "luspo", "dr_grpo")
SHAPES = {"spg = acc": 2, "spg = 2×acc": 4, "spg = acc/2": 1}


def worst(trainer_cls, folder: Path, out: Path, loss_type: str, spg: int, iterations: int, beta: float, **extra):
    args = sgd_config(out, 2, spg, num_iterations=iterations, beta=beta, loss_type=loss_type, **extra)
    with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints each step's logs without a progress bar
        trainer, steps = train_grpo(trainer_cls, folder, args)
    return max(step_errors(trainer, steps, folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss-types", default=",".join(LOSS_TYPES))
    parser.add_argument("--steps", type=int, default=2)
    cli = parser.parse_args()
    hf_logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_policy_folder(Path(tmp) / "policy")
        print("| loss type | steps_per_generation | num_iterations | beta | entropy_coef | GRPOTrainer | ours |")
        print("|---|---|---|---|---|---|---|")
        cells = itertools.product(cli.loss_types.split(","), SHAPES.items(), (1, 2), (0.0, 0.04), (0.0, 0.05))
        for loss_type, (shape, spg), iterations, beta, entropy in cells:
            if (entropy and (beta or iterations > 1)) or (spg == 1 and iterations > 1):
                continue  # the entropy bonus once per shape; ½× with one iteration
            extra = dict(max_steps=cli.steps, entropy_coef=entropy)
            found = [
                worst(cls, folder, Path(tmp) / "out", loss_type, spg, iterations, beta, **extra)
                for cls in (trl.GRPOTrainer, TokenNormGRPOTrainer)
            ]
            print(f"| {loss_type} | {shape} | {iterations} | {beta} | {entropy} | {found[0]:.1e} | {found[1]:.1e} |")


if __name__ == "__main__":
    main()
