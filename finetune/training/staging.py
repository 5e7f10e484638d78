"""A save written by all ranks together that lands complete or absent: a checkpoint (checkpoints.py), the best model
(evaluation.py) and the final set (lifecycle.py) are each written into a staged folder first, then moved into place.

`save_staged`, the one skeleton: rank 0 clears what a killed save left in the staged folder; every rank writes its
part (the Trainer's save: FSDP shards, ZeRO-3 gathering, rng_state_R.pth); once all have, rank 0 adds its own files
(last the one that marks the folder complete) and moves the folder into place. Whatever stops it (a full disk, a bug,
Ctrl-C), the staged folder is removed; a failed write is one line naming what was written (write_faults.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable

from finetune.training.write_faults import write_error, write_failure

STAGING = ".staging"  # inside train.output_dir: checkpoints and the best model being written; never resumed from


def save_staged(trainer, staged: str, what: str, write: Callable[[str], None], finish: Callable[[str], None]) -> None:
    """`write(staged)` on every rank, then `finish(staged)` on rank 0: its files and the move into place.

    `what` names the save in the error of a failed write ("checkpoint-4", "the best model"). Every rank calls it.
    """
    main = trainer.args.should_save
    if main:
        shutil.rmtree(staged, ignore_errors=True)  # left by a save that was killed
    trainer.accelerator.wait_for_everyone()
    try:
        write(staged)
        trainer.accelerator.wait_for_everyone()  # every rank's files are in `staged`
        if main:
            finish(staged)
    except BaseException as e:  # a full disk, a bug, Ctrl-C: nothing half-written stays behind
        failure = write_failure(e, staged)  # judged before the files are removed (a full disk is no longer full then)
        shutil.rmtree(staged, ignore_errors=True)
        if failure is None:
            raise
        raise write_error(trainer.args.output_dir, what, failure) from None
    trainer.accelerator.wait_for_everyone()


@contextlib.contextmanager
def removed_when_empty(folder: str, main: bool):
    """`folder` (where saves are staged) is removed after the block, on rank 0, when the block left it empty."""
    try:
        yield folder
    finally:
        if main:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
