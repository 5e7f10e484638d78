"""`python -m finetune.plan recipe=… [plan.headroom=0.1] [plan.memory_gib=24] [plan.ranks=8]`: runs
`finetune.tools.plan.main` (as the `finetune-plan` console script does); nothing imports this module."""

import sys

from finetune.env import exit_process
from finetune.tools.plan import main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
