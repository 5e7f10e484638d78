"""`finetune/train.py` as users run it, killed with SIGKILL at a chosen point (for tests/test_resume.py).

    python tests/workers/resume_worker.py KILL_AT recipe=recipes/debug.yaml key=value ...

KILL_AT: `none`; `window:N` (inside optimizer step N's accumulation window, after its first micro-batch);
`term:N` (SIGTERM from rank 0 to itself inside step N's window, after its first micro-batch: a stop mid-window);
`step:N` (after step N's update, before its checkpoint is written); `save:N` (while checkpoint-N is being written:
weights on disk, optimizer state not yet, nothing renamed); `commit:N` (checkpoint-N fully written, not yet renamed).
"""

from __future__ import annotations

import os
import signal
import sys

from transformers import TrainerCallback

import finetune.tools.train
from finetune.env import is_main_process
from finetune.training import checkpoints
from finetune.training.recipe_trainer import RecipeTrainer


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(TrainerCallback):
    def __init__(self, kind: str, step: int):
        self.kind, self.step = kind, step

    def on_substep_end(self, args, state, control, **kwargs):  # after a micro-batch that is not a window's last
        if self.kind == "window" and state.global_step == self.step - 1:
            die()
        if self.kind == "term" and state.global_step == self.step - 1 and is_main_process():
            self.kind = "sent"
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_end(self, args, state, control, **kwargs):
        if self.kind == "step" and state.global_step == self.step:
            die()


def arm(kill_at: str) -> tuple:
    if kill_at == "none":
        return ()
    kind, step = kill_at.split(":")
    step = int(step)
    if kind == "save":
        write = RecipeTrainer._save_optimizer_and_scheduler

        def write_then_die(self, output_dir):
            if self.state.global_step == step:
                die()
            write(self, output_dir)

        RecipeTrainer._save_optimizer_and_scheduler = write_then_die
    elif kind == "commit":
        commit = checkpoints.commit

        def die_before_rename(staged, final):
            if final.endswith(f"checkpoint-{step}"):
                die()
            commit(staged, final)

        checkpoints.commit = die_before_rename
    return (KillAt(kind, step),)


if __name__ == "__main__":
    callbacks = arm(sys.argv[1])
    train = finetune.tools.train.train
    finetune.tools.train.train = lambda cfg, argv=None, plan=None: train(cfg, callbacks=callbacks, argv=argv, plan=plan)
    sys.exit(finetune.tools.train.main(sys.argv[2:]))
