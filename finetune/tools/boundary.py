"""The one boundary of every command (train, plan, verify; on every rank under a launcher): what the user can fix is
one `error:` line and exit code 2 (RecipeError, raised where the problem enters: a key, a file, a row); anything
else is a bug in finetune and keeps its traceback, with exit code INTERNAL_ERROR.

Faults of the machine or of a peer rank are not bugs either: a write that failed (ENOSPC, EDQUOT, EROFS, EACCES,
EFBIG, EIO: advice matching the errno), host or device memory running out, a peer rank that died (named by the
ranks that survive it, each printing its own line) are one `error:` line and exit code 2.

Exit codes: 0 done; 1 verify's check failed; 2 a recipe, data, model, checkpoint, launch or machine problem (one
line, nothing written); 3 stopped on a non-finite value (train.on_nonfinite=stop); 70 an internal error (a bug: please
report it with the traceback); 130 / 143 (128 + the signal) stopped by SIGINT / SIGTERM after saving the last
optimizer step: resume with train.resume_from=auto.
"""

from __future__ import annotations

import re
import sys
import time
import traceback
from collections.abc import Callable

from finetune.env import WRITE_ADVICE, is_main_process, rank, world_size, write_advice
from finetune.recipe import RecipeError, first_line

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


# a launcher stops every rank once one exits: another rank that returned first would have the main process killed
# before its `error:` line, so it waits this long; the main process meeting the same error prints and exits meanwhile
MAIN_PROCESS_FIRST_S = 15.0


def print_error(message: str, every_rank: bool = False) -> None:
    """`error: …` on a line of its own, once: by the main process (every rank meets the same recipe), or by
    `every_rank` (a fault one rank meets, such as its peer dying). Another rank still running after the main
    process's turn met the error alone, and prints it with its rank."""
    if not (every_rank or is_main_process()):
        time.sleep(MAIN_PROCESS_FIRST_S)  # the launcher ends it when the main process exits
        every_rank = True
    if every_rank and world_size() > 1:
        message = f"rank {rank()}: {message}"
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


HOST_OOM = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)|std::bad_alloc")
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|NCCL communicator was aborted|"
    r"remote process exited or there was a network error"
)
DIST_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


def machine_fault(error: BaseException) -> str | None:
    """The `error:` line's message for a fault of the machine or a peer (every rank that meets one prints it)."""
    first = first_line(error)
    if type(error).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return (
            f"out of device memory ({first[:200]}); lower train.micro_batch_size (or set it to auto) or "
            "data.max_length, or set train.gradient_checkpointing=true"
        )
    if isinstance(error, MemoryError) or HOST_OOM.search(first):
        return (
            f"out of host memory ({first[:200] or 'MemoryError'}); lower train.micro_batch_size, "
            "data.max_length or data.num_workers, run fewer ranks per machine, or use one with more memory"
        )
    if isinstance(error, OSError) and error.errno is not None and error.errno in WRITE_ADVICE:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror or first}; {write_advice(error.errno)}"
    from finetune.training.write_faults import write_failure

    failure = write_failure(error) if isinstance(error, RuntimeError) else None
    if failure is not None:  # a torch or safetensors file outside a staged save
        return f"writing a file failed ({failure.why}); {write_advice(failure.code)}"
    if type(error).__name__ in DIST_ERRORS or (isinstance(error, RuntimeError) and PEER_LOST.search(first)):
        peer = f"rank {1 - rank()}" if world_size() == 2 else "another rank"
        said = re.sub(r"^\[[^\]]*\] *", "", first).split(". ")[0][:160]  # gloo: "[pair.cc:537] Read error …"
        return (
            f"lost {peer} ({said}): {peer} stopped first (killed, out of memory, or its "
            "machine failed); its own error line or the launcher's report says why. Resume with "
            "train.resume_from=auto"
        )
    return None


def run_command(body: Callable[[], int]) -> int:
    """`body()`'s exit code, with every error turned into one: see the module docstring."""
    try:
        return body()
    except RecipeError as e:
        print_error(_own_line(str(e)))
        return getattr(e, "exit_code", 2)  # 3: training stopped on a non-finite value (train.on_nonfinite=stop)
    except Exception as e:
        fault = machine_fault(e)
        if fault is not None:
            print_error(_own_line(fault), every_rank=True)
            return 2
        _close_progress_bars()
        traceback.print_exc()
        print(
            f"internal error ({type(e).__name__}): a bug in finetune, not in your recipe or data; please report "
            "it with the traceback above",
            file=sys.stderr,
            flush=True,
        )
        return INTERNAL_ERROR
