"""One command's body meeting a RecipeError on every rank: `same:S` on every rank, the main process S seconds after
the others (a main process slower to get there, as on a loaded machine); `alone:R` on rank R only, the others
finishing. The boundary (`run_command`) turns it into the command's `error:` line and exit code."""

import sys
import time

from finetune.env import exit_process, is_main_process, rank
from finetune.recipe import RecipeError
from finetune.tools.boundary import run_command


def body(case: str, value: str) -> int:
    if case == "same":
        if is_main_process():
            time.sleep(float(value))
        raise RecipeError("the recipe is wrong")
    if rank() == int(value):
        raise RecipeError("this rank's data is wrong")
    return 0


if __name__ == "__main__":
    exit_process(run_command(lambda: body(*sys.argv[1].split(":"))))
