"""finetune.env.exit_process with WORLD_SIZE from the environment: exits with argv[1] after the exit handlers, and
tears down its objects only outside a launched rank (for tests/test_distributed.py)."""

import atexit
import sys

from finetune.env import exit_process


class Held:
    def __del__(self):
        print("torn down", flush=True)


held = Held()  # a module global: freed only by the interpreter's teardown
atexit.register(lambda: print("exit handlers ran"))
print("unflushed", end="")
exit_process(int(sys.argv[1]))
