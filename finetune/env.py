"""The process environment, read in one place: ranks, the main process, how the process was launched, the cache.

Launchers describe each rank through environment variables, known before any process group exists: torchrun and
`accelerate launch` set WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE; every `accelerate launch` sets
ACCELERATE_MIXED_PRECISION, torchrun (also under accelerate's multi-process launch) TORCHELASTIC_RUN_ID.
`exit_process` ends a launched rank without tearing its objects down; `write_advice` and `why_writes_fail` say what a
failed write means on this machine (the disk, not the recipe). Imports no torch: the entry points use this module
before the recipe is known good.
"""

from __future__ import annotations

import atexit
import errno
import gc
import os
import resource
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


THREADS = "OMP_NUM_THREADS"
THREADS_OPTION = "--num_cpu_threads_per_process"  # accelerate launch's own way to choose it


def launcher(pid: int | None = None) -> tuple[dict[str, str], list[str]] | None:
    """The environment and command line the launcher process (this one's parent) was started with, where /proc
    shows them (Linux); None elsewhere."""
    pid = os.getppid() if pid is None else pid
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in environ if item)
    return {k: v for k, _, v in pairs}, [a.decode(errors="replace") for a in argv if a]


def threads_chosen(environ: Mapping[str, str] = os.environ, launched_by=launcher) -> int | None:
    """OMP_NUM_THREADS when the user chose it, else None. `accelerate launch` sets it to 1 (torchrun too, for
    several ranks) when the user did not: under a launcher it counts only where the launcher's own environment had
    it or `--num_cpu_threads_per_process` was passed (where that cannot be seen, it counts)."""
    value = environ.get(THREADS, "").strip()
    if not value.isdigit() or int(value) < 1:
        return None
    if launch_kind(environ) != "plain":
        seen = launched_by()
        if seen is not None and THREADS not in seen[0] and not any(a.startswith(THREADS_OPTION) for a in seen[1]):
            return None  # the launcher's default, not the user's choice
    return int(value)


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads do not speed up matrix products)."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
    except ImportError:
        physical = logical
    return max(1, min(physical, logical))


def cpu_threads(environ: Mapping[str, str] = os.environ, launched_by=launcher) -> tuple[int, str]:
    """(threads for a CPU run, why): OMP_NUM_THREADS where the user chose it, else every physical core shared by
    the ranks on this machine."""
    chosen = threads_chosen(environ, launched_by)
    if chosen is not None:
        return chosen, f"{THREADS}={chosen}"
    ranks = local_world_size(environ)
    cores = physical_cores()
    share = f" shared by {ranks} ranks" if ranks > 1 else ""
    return max(1, cores // ranks), f"{cores} physical cores{share}; {THREADS}=N chooses"


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where converted models, assembled VLMs and built-in data sets are kept: $FINETUNE_CACHE or ~/.cache/finetune."""
    return Path(environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune"))


# set by finetune-launch (finetune/tools/launcher.py) for the ranks under it: the file a stopped run writes its exit
# code to, since torchrun and a multi-process `accelerate launch` exit 1 whatever their ranks return
STOP_CODE_FILE = "FINETUNE_STOP_CODE_FILE"


def report_stop_code(code: int, environ: Mapping[str, str] = os.environ) -> None:
    """A run stopped by a signal tells finetune-launch its exit code (each machine's local rank 0 writes it)."""
    if (path := environ.get(STOP_CODE_FILE)) and local_rank(environ) == 0:
        Path(path).write_text(f"{code}\n")


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


WRITE_ADVICE = {  # errno of a failed write (or read) → what to do; the machine's fault, not the recipe's
    errno.ENOSPC: "the disk is full; free space there or choose another train.output_dir, then resume",
    errno.EDQUOT: "your disk quota is used up; free space within it or choose a folder on another file system",
    errno.EROFS: "the file system is read-only (a disk error can remount it so); choose a writable folder",
    errno.EACCES: "no permission for it; fix its permissions or choose a folder you can write to",
    errno.EPERM: "no permission for it; fix its permissions or choose a folder you can write to",
    errno.EFBIG: "a file grew past this process's file size limit (ulimit -f); raise it (ulimit -f unlimited)",
    errno.EIO: "the disk reported an I/O error; check it (dmesg) before resuming from the last checkpoint",
}


def write_advice(code: int | None) -> str:
    return WRITE_ADVICE.get(code, "check the disk of that folder, then resume from the last checkpoint")


def why_writes_fail(folder: str) -> int | None:
    """The errno a write into `folder` most likely failed with, for writers that report none (torch.save's C++
    writer): a read-only file system, no permission, a full disk, a file size limit; None when none of these holds."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        stat = os.statvfs(folder or ".")
    except OSError:
        return None
    if stat.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if not os.access(folder or ".", os.W_OK):
        return errno.EACCES
    if stat.f_bavail * stat.f_frsize < 2**20:
        return errno.ENOSPC
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return errno.EFBIG
    return None
