"""A save that failed to write (a full disk, a quota, a read-only or unwritable folder, a file size limit): one line
naming what was written and advice that matches the errno, never a traceback. Used by every staged save
(staging.save_staged: a checkpoint, the best model, the final set), which removes what it staged first."""

from __future__ import annotations

import dataclasses
import os
import re

from finetune.env import why_writes_fail, write_advice
from finetune.recipe import RecipeError, first_line


@dataclasses.dataclass
class WriteFailure:
    """Why a save failed to write: the writer's words and its errno (None: the writer gave none, as torch's)."""

    why: str
    code: int | None = None
    guessed: bool = False  # code judged from the folder (the writer gave none)


# torch.save's C++ writer reports a failed write without an errno; safetensors as "I/O error: … (os error N)"
TORCH_WRITE = re.compile(r"inline_container\.cc|PytorchStreamWriter|file write failed|unexpected pos \d+")


def write_failure(error: BaseException, folder: str | None = None) -> WriteFailure | None:
    """Why a save failed, if it failed to write (full disk, quota, read-only, permission, file size limit); None for
    any other error. `folder`: where it wrote, judged for the errno a writer gave none of (before its files are
    removed: a full disk is no longer full then)."""
    if isinstance(error, OSError):
        return WriteFailure(error.strerror or type(error).__name__, error.errno)
    first = first_line(error)
    match = re.search(r"I/O error: (.+?)(?: \(os error (\d+)\))?$", first)
    if match:
        return WriteFailure(match.group(1), int(match.group(2)) if match.group(2) else None)
    if isinstance(error, RuntimeError) and TORCH_WRITE.search(first):
        return WriteFailure("torch.save could not write its file", why_writes_fail(folder) if folder else None, True)
    return None


def write_error(output_dir: str, what: str, failure: WriteFailure) -> RecipeError:
    code, guessed = failure.code, failure.guessed
    if code is None:
        code, guessed = why_writes_fail(output_dir), True
    why = f"{failure.why}: {os.strerror(code)}" if guessed and code is not None else failure.why
    return RecipeError(
        f"train.output_dir={output_dir}: writing {what} failed ({why}); {write_advice(code)} "
        "(nothing half-written was left there)"
    )
