"""`python -m finetune.verify recipe=… [verify.steps=2] [verify.tolerance=1e-5]`, also under `accelerate launch -m`:
runs `finetune.tools.verify.main` (as the `finetune-verify` console script does); nothing imports this module."""

import sys

from finetune.env import exit_process
from finetune.tools.verify import main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
