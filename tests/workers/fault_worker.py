"""`finetune/train.py` with a fault injected by the test: `die:R:N` kills rank R with SIGKILL after optimizer step N
(a peer that dies, as the OOM killer or a lost machine does). The arguments after the first are the recipe's."""

import os
import signal
import sys

from transformers import TrainerCallback

from finetune.env import exit_process, rank
from finetune.recipe import load_config
from finetune.tools.boundary import run_command
from finetune.tools.train import train


class DieAt(TrainerCallback):
    def __init__(self, who: int, step: int):
        self.who, self.step = who, step

    def on_step_end(self, args, state, control, **kwargs):
        if rank() == self.who and state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    _, who, step = sys.argv[1].split(":")
    exit_process(run_command(lambda: train(load_config(sys.argv[2:]), callbacks=(DieAt(int(who), int(step)),))))
