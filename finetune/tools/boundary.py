"""The one boundary of every command (train, plan, verify; on every rank under a launcher): what the user can fix is
one `error:` line and exit code 2 (RecipeError, raised where the problem enters: a key, a file, a row); anything
else is a bug in finetune and keeps its traceback, with exit code INTERNAL_ERROR.

Exit codes: 0 done; 1 verify's check failed; 2 a recipe, data, model, checkpoint or launch problem (one line, nothing
written); 3 stopped on a non-finite value (train.on_nonfinite=stop); 70 an internal error (a bug: please report it
with the traceback).
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable

from finetune.env import is_main_process
from finetune.recipe import RecipeError

INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE: neither 1 (verify's failed check) nor 2 (the user's input)


def _close_progress_bars() -> None:
    """A progress bar left open (an error mid-training) holds the console line; closing it ends that line, so the
    error gets a line of its own, and the bar is not drawn again below it at exit."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:  # a bar that cannot redraw must not hide the error
            pass


def print_error(message: str) -> None:
    """`error: …` on a line of its own, on the main process only (every rank meets the same recipe)."""
    if not is_main_process():
        return
    _close_progress_bars()
    sys.stdout.flush()
    line = f"error: {message}"
    encoding = sys.stderr.encoding or "utf-8"
    print(line.encode(encoding, "backslashreplace").decode(encoding), file=sys.stderr, flush=True)


def _own_line(message: str) -> str:
    """torch re-raises a DataLoader worker's exception with the worker's traceback inside its message; the user's line
    is the traceback's last one, after the exception's name."""
    if "Original Traceback" not in message:
        return message
    match = re.match(r"^[\w.]+: (.*)$", message.strip().splitlines()[-1])
    return match.group(1) if match else message.strip().splitlines()[-1]


def _out_of_memory(error: BaseException) -> bool:
    return type(error).__name__ == "OutOfMemoryError"  # torch.OutOfMemoryError, without importing torch here


def run_command(body: Callable[[], int]) -> int:
    """`body()`'s exit code, with every error turned into one: see the module docstring."""
    try:
        return body()
    except RecipeError as e:
        print_error(_own_line(str(e)))
        return getattr(e, "exit_code", 2)  # 3: training stopped on a non-finite value (train.on_nonfinite=stop)
    except Exception as e:
        if _out_of_memory(e):
            first = str(e).splitlines()[0] if str(e) else ""
            print_error(f"out of memory ({first[:200]}); lower train.micro_batch_size (or set it to auto) or "
                        "data.max_length, or set train.gradient_checkpointing=true")
            return 2
        _close_progress_bars()
        traceback.print_exc()
        print(f"internal error ({type(e).__name__}): a bug in finetune, not in your recipe or data; please report "
              "it with the traceback above", file=sys.stderr, flush=True)
        return INTERNAL_ERROR
