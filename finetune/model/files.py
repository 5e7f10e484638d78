"""Whether the files of a model folder or a checkpoint are whole, each damaged file named, before anything loads;
and `commit`, the package's one write-then-rename: whatever is saved (a checkpoint, the best model, a converted model
in the cache) is written aside, flushed to disk, then renamed into place, so it is complete or absent.

Checked by kind, cheaply: a JSON file parses; a safetensors file has its header and every tensor byte the header
promises (a cut file is short of them); a torch file (.pt/.pth/.bin, a zip) has its directory, which zip keeps at the
end. Bytes are not hashed: a flipped bit inside a tensor is not found here. finetune/training/checkpoint_files.py
adds the sizes recorded at save time.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile

from finetune.recipe import first_line

NEVER_LOADED = {"training_args.bin"}  # the Trainer's pickle: nothing loads it
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _safetensors_problem(path: str, size: int) -> str | None:
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else size
        if length > size - 8:
            return f"cut short ({size:,} bytes, less than its header)"
        try:
            header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return "not a safetensors file (its header does not parse)"
    expected = 8 + length + end
    return f"cut short ({size:,} of {expected:,} bytes)" if size < expected else None


def file_problem(path: str) -> str | None:
    """What is wrong with one file, judged by its kind; None when it looks whole (or is of another kind)."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        if name.endswith(".json"):
            with open(path, "rb") as f:
                json.loads(f.read().decode("utf-8"))
        elif name.endswith(".safetensors"):
            return _safetensors_problem(path, size)
        elif name.endswith((".pt", ".pth", ".bin")) and name not in NEVER_LOADED:
            with zipfile.ZipFile(path) as archive:  # torch.save's format: a zip whose directory is at the end
                archive.infolist()
    except (ValueError, zipfile.BadZipFile) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        kind = "JSON" if name.endswith(".json") else "torch file"
        return f"not a whole {kind} ({size:,} bytes; {first_line(e)})"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return None


def folder_problems(folder: str, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """{file relative to folder: what is wrong} for every file there (sub-folders included) but `skip`."""
    problems = {}
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative not in skip and (problem := file_problem(os.path.join(root, name))):
                problems[relative] = problem
    return problems


# ---- written whole ----


def fsync(path: str) -> None:
    """One file's or folder's entry flushed to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flush_tree(path: str) -> None:
    """Every file under `path` (a folder, or one file) and every folder flushed to disk."""
    if not os.path.isdir(path):
        fsync(path)
        return
    for folder, _, files in os.walk(path):
        for name in files:
            fsync(os.path.join(folder, name))
        fsync(folder)


def commit(staged: str, final: str) -> None:
    """Move a fully written file or folder into place in one rename (same filesystem: `staged` is beside `final` or
    in a folder next to it).

    The files are flushed to disk first, so after a power loss the rename never points at empty files.
    """
    flush_tree(staged)
    if os.path.isdir(staged) and os.path.exists(final):  # e.g. resumed from an older checkpoint: the new one wins
        old = staged + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)
    fsync(os.path.dirname(os.path.abspath(final)))
