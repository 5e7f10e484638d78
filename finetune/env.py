"""The process environment, read in one place: ranks, the main process, how the process was launched, the cache.

Launchers describe each rank through environment variables, known before any process group exists: torchrun and
`accelerate launch` set WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE; every `accelerate launch` sets
ACCELERATE_MIXED_PRECISION, torchrun (also under accelerate's multi-process launch) TORCHELASTIC_RUN_ID.
`exit_process` ends a launched rank without tearing its objects down. Imports no torch: the entry points use this
module before the recipe is known good.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn


def world_size(environ: Mapping[str, str] = os.environ) -> int:
    """Ranks the launcher started; 1 without one."""
    return int(environ.get("WORLD_SIZE", "1"))


def rank(environ: Mapping[str, str] = os.environ) -> int:
    return int(environ.get("RANK", "0"))


def local_rank(environ: Mapping[str, str] = os.environ) -> int:
    return int(environ.get("LOCAL_RANK", "0"))


def local_world_size(environ: Mapping[str, str] = os.environ) -> int:
    """Ranks on this machine (they share its memory)."""
    return int(environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Rank 0: the one that prints and writes what the whole run writes once."""
    return rank(environ) == 0


def launch_kind(environ: Mapping[str, str] = os.environ) -> str:
    """plain (`python …`), accelerate (`accelerate launch`, any number of ranks) or torchrun."""
    if "ACCELERATE_MIXED_PRECISION" in environ:
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun"
    return "plain"


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where converted models, assembled VLMs and built-in data sets are kept: $FINETUNE_CACHE or ~/.cache/finetune."""
    return Path(environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune"))


def exit_process(code: int) -> NoReturn:
    """Exit, skipping the interpreter's object teardown on a launched rank (WORLD_SIZE > 1).

    gloo's worker thread drops the last collective's tensors under the group's lock and needs the GIL for it, after
    wait() has returned. A process group object freed in that moment deadlocks (its destructor holds the GIL and waits
    for the lock) when the collector frees it, and aborts the rank ("terminate called without an active exception")
    when interpreter shutdown frees it. So the exit handlers run (W&B, logging) with the collector off, and the process
    ends without tearing objects down; everything the run wrote is closed by then.
    """
    if world_size() <= 1:
        sys.exit(code)
    gc.disable()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
