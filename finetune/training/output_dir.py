"""train.output_dir held by one run at a time, and a final save that swaps whole sets: never a folder mixing two runs.

The lock: `OUTPUT_DIR/.lock`, held with flock by rank 0 for the whole run. The OS drops a flock when its process
dies, kill -9 included, so a lock is never stale; the file only says who holds it (pid, host, start time).

The final save: the model, its tokenizer, trainer_state.json and recipe.yaml are written whole into a sibling folder
(`.NAME.final` beside OUTPUT_DIR; all ranks write there, FSDP/ZeRO-3 gather). Then everything in OUTPUT_DIR that is not
the previous final set (checkpoints, W&B, best/, your own files) is moved into it, and the two folders are exchanged in
one rename (renameat2 RENAME_EXCHANGE; elsewhere two renames, with OUTPUT_DIR briefly absent, never mixed). The
previous final set, now in the sibling, is removed. `FINAL_SET` in each final set names its files, so the next save
knows which files were the model. A run killed on the way leaves the sibling; the next run on OUTPUT_DIR puts back what
was moved into it (the old model stays) or removes it (the new model is in place): `recover`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from finetune.env import is_main_process
from finetune.model.files import fsync
from finetune.recipe import RecipeError
from finetune.training.staging import STAGING

LOCK = ".lock"
FINAL_SET = ".final_set.json"  # in a final set: the names of its files and folders
CARRIED = ".carried.json"  # in the sibling while the save moves entries into it: their names
# Files a final save writes (also of older versions, which kept no FINAL_SET): without FINAL_SET, these are the old set
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "trainer_state.json",
    "recipe.yaml",
    "training_args.bin",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
    "merges.txt",
)
MODEL_PREFIXES = ("model", "pytorch_model", "adapter_", "tokenizer", "vocab")


def sibling(output_dir: str) -> Path:
    out = Path(output_dir).resolve()
    return out.parent / f".{out.name}.final"


class OutputLock:
    """flock on OUTPUT_DIR/.lock (rank 0). `acquire` raises RecipeError naming the holder when another run has it;
    `release` removes the file, and OUTPUT_DIR with the folders above it that the lock created, when empty."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = Path(output_dir) / LOCK
        self.file = None
        self.made: list[Path] = []

    def acquire(self) -> None:
        out = Path(self.output_dir)
        self.made = [p for p in [out, *out.parents] if not p.exists()]
        try:
            out.mkdir(parents=True, exist_ok=True)
            while True:
                file = open(self.path, "a+")
                try:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    file.seek(0)
                    holder = file.read().strip() or "another process"
                    file.close()
                    raise RecipeError(
                        f"train.output_dir={self.output_dir} is in use by another run ({holder}); wait "
                        "for it to end, or choose another train.output_dir"
                    ) from None
                # the holder before us may have removed the file after we opened it: lock the file that is there now
                if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(file.fileno()).st_ino:
                    break
                file.close()
            file.seek(0)
            file.truncate()
            file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
            file.flush()
            self.file = file
        except OSError as e:
            self._remove_made()
            raise RecipeError(
                f"train.output_dir={self.output_dir}: cannot write there ({e.strerror or e}); choose a writable folder"
            ) from None

    def adopt(self, file) -> None:
        """After the final save's exchange, the lock file of the new folder (locked already) is the one held."""
        old, self.file = self.file, file
        if old is not None:
            old.close()

    def release(self) -> None:
        if self.file is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)  # while still locked: a waiting run then finds no file, or a new one
        self.file.close()
        self.file = None
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self.made:  # deepest first; only when empty: nothing else was written
            with contextlib.suppress(OSError):
                folder.rmdir()


_held: dict[Path, OutputLock] = {}  # the lock this process holds, by resolved OUTPUT_DIR


@contextlib.contextmanager
def claimed(output_dir: str):
    """OUTPUT_DIR is this run's while the block runs (rank 0 holds the lock; other ranks follow rank 0), after a final
    save that was interrupted is cleaned up."""
    if not is_main_process():
        yield
        return
    lock = OutputLock(output_dir)
    lock.acquire()
    key = Path(output_dir).resolve()
    _held[key] = lock
    try:
        if os.path.ismount(key):
            raise RecipeError(
                f"train.output_dir={output_dir} is a mount point; the final save swaps the folder with "
                "a sibling, so choose a folder inside it"
            )
        for line in (recover(output_dir), remove_interrupted_saves(output_dir)):
            if line:
                print(line, flush=True)
        yield
    finally:
        _held.pop(key, None)
        lock.release()


def _final_names(out: Path) -> set[str]:
    """The names of the final set in `out`: as its FINAL_SET says, else the files a final save writes."""
    with contextlib.suppress(OSError, ValueError):
        return set(json.loads((out / FINAL_SET).read_text()))
    return {
        p.name for p in out.iterdir() if p.is_file() and (p.name in MODEL_FILES or p.name.startswith(MODEL_PREFIXES))
    }


def _exchange(a: Path, b: Path) -> None:
    """Swap two folders: atomically where the kernel can (Linux renameat2), else with a third name."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2") and a.parent == b.parent:
        rename_exchange = 2
        parent = os.open(a.parent, os.O_RDONLY)
        try:
            done = libc.renameat2(parent, os.fsencode(a.name), parent, os.fsencode(b.name), rename_exchange) == 0
        finally:
            os.close(parent)
        if done:
            return
        if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(a))
    parked = b.with_name(b.name + ".old")
    os.replace(a, parked)
    os.replace(b, a)
    os.replace(parked, b)


def swap_in(output_dir: str, staged: Path) -> None:
    """`staged` (a complete final set, in `sibling(output_dir)`) becomes OUTPUT_DIR's final set: see the module."""
    out = Path(output_dir).resolve()
    lock = _held.get(out)
    new = sorted(p.name for p in staged.iterdir())
    (staged / FINAL_SET).write_text(json.dumps(new))
    old = _final_names(out)
    carried = sorted(p.name for p in out.iterdir() if p.name not in old | set(new) | {LOCK, FINAL_SET, CARRIED})
    new_lock = open(staged / LOCK, "a+")  # locked before the exchange: the lock never leaves OUTPUT_DIR
    fcntl.flock(new_lock, fcntl.LOCK_EX)
    (staged / CARRIED).write_text(json.dumps(carried))
    for folder in (staged, staged.parent):
        fsync(folder)
    for name in carried:
        os.replace(out / name, staged / name)
    _exchange(out, staged)
    if lock is not None:
        lock.adopt(new_lock)
    with contextlib.suppress(OSError):
        os.remove(out / CARRIED)
    shutil.rmtree(staged, ignore_errors=True)  # the previous final set
    fsync(out.parent)


def remove_interrupted_saves(output_dir: str) -> str | None:
    """What a checkpoint or best-model save that was stopped on the way (a second stop signal, a kill) left in the
    staging folder is removed before anything else: a line naming it, or None when there was nothing."""
    staging = Path(output_dir) / STAGING
    left = sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []
    if not left:
        return None
    shutil.rmtree(staging, ignore_errors=True)
    return (
        f"note: {output_dir}: a save was stopped before it was whole ({', '.join(left)} in {STAGING}); removed it, "
        "the whole checkpoints are as they were"
    )


def recover(output_dir: str) -> str | None:
    """Finish what a final save killed on the way left (under the lock, before anything else): entries it had moved
    into the sibling go back, the rest of the sibling is removed. A line to print, or None when there was nothing."""
    out, staged = Path(output_dir).resolve(), sibling(output_dir)
    parked = staged.with_name(staged.name + ".old")
    if parked.is_dir() and not out.exists():  # killed between the two renames of a fallback exchange
        os.replace(parked, out)
    if not staged.exists() and not parked.exists():
        return None
    moved = []
    with contextlib.suppress(OSError, ValueError):
        for name in json.loads((staged / CARRIED).read_text()):
            if (staged / name).exists() and not (out / name).exists():
                os.replace(staged / name, out / name)
                moved.append(name)
    shutil.rmtree(staged, ignore_errors=True)
    shutil.rmtree(parked, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.remove(out / CARRIED)
    return f"note: {output_dir}: a final save was interrupted; cleaned up" + (
        f" ({len(moved)} entries moved back: {', '.join(moved[:4])})" if moved else ""
    )
