"""One command's body meeting the same RecipeError on every rank, the main process `argv[1]` seconds after the
others (a main process slower to get there, as on a loaded machine). The boundary (`run_command`) turns it into the
command's `error:` line and exit code."""

import sys
import time

from finetune.env import exit_process, is_main_process
from finetune.recipe import RecipeError
from finetune.tools.boundary import run_command


def body(main_process_delay_s: float) -> int:
    if is_main_process():
        time.sleep(main_process_delay_s)
    raise RecipeError("the recipe is wrong")


if __name__ == "__main__":
    exit_process(run_command(lambda: body(float(sys.argv[1]))))
