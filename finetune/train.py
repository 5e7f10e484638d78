"""The training entry script: `python finetune/train.py recipe=… [key=value …]`, or under `accelerate launch`.

    accelerate launch finetune/train.py recipe=recipes/quickstart.yaml optim.lr=1e-5
    python finetune/train.py recipe=debug train.max_steps=3

It runs `finetune.tools.train.main` (as the `finetune-train` console script does); nothing imports this file.
"""

import sys

from finetune.env import exit_process
from finetune.tools.train import main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
