"""Whether a checkpoint's files are whole, each damaged file named, before anything loads from it.

A checkpoint is renamed into place only once complete (checkpoints.save_atomically), but a file can still be cut or
damaged later (a copy that stopped, a full disk during `cp`, a bad sector). Every file's size is recorded in SIZES
just before the state file that marks the folder complete; at resume each file is checked against it and by its kind:
JSON parses, a safetensors header and the tensor bytes it promises are all there, a torch file's zip directory (kept
at the end of the file) is intact. Bytes are not hashed: a flipped bit inside a tensor is not found here.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile

from finetune.env import is_main_process
from finetune.recipe import RecipeError

SIZES = "checkpoint_files.json"  # {file: bytes} of every file of the checkpoint
NEVER_LOADED = {"training_args.bin"}  # the Trainer's pickle: nothing loads it


def record_sizes(folder: str) -> None:
    sizes = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, SIZES), "w") as f:
        json.dump(sizes, f, indent=1, sort_keys=True)


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


def _problem(path: str, name: str) -> str | None:
    size = os.path.getsize(path)
    try:
        if name.endswith(".json"):
            with open(path, "rb") as f:
                json.loads(f.read().decode("utf-8"))
        elif name.endswith(".safetensors"):
            return _safetensors_problem(path, size)
        elif name.endswith((".pt", ".pth", ".bin")) and name not in NEVER_LOADED:
            with zipfile.ZipFile(path) as archive:  # torch.save's format: a zip whose directory is at the end
                archive.infolist()
    except (ValueError, zipfile.BadZipFile) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        kind = "JSON" if name.endswith(".json") else "torch file"
        return f"not a whole {kind} ({size:,} bytes; {str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return None


def damaged(folder: str) -> list[str]:
    """What is wrong with the checkpoint's files, one entry per file ("optimizer.pt: cut short (…)"); [] when whole."""
    problems: dict[str, str] = {}
    sizes: dict[str, int] = {}
    try:
        with open(os.path.join(folder, SIZES)) as f:
            sizes = json.load(f)
    except FileNotFoundError:
        pass  # written by an older version: the files are checked by their kind only
    except (OSError, ValueError) as e:
        problems[SIZES] = f"unreadable ({e})"
    for name, size in sizes.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems[name] = "missing"
        elif os.path.getsize(path) != size:
            problems[name] = f"{os.path.getsize(path):,} bytes, written as {size:,}"
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative not in problems and relative != SIZES:
                try:
                    problem = _problem(os.path.join(root, name), name)
                except OSError as e:
                    problem = f"unreadable ({e.strerror or e})"
                if problem:
                    problems[relative] = problem
    return [f"{name}: {why}" for name, why in sorted(problems.items())]


def check_whole(folder: str) -> None:
    """RecipeError naming every damaged file of the checkpoint train.resume_from names."""
    problems = damaged(folder)
    if problems:
        raise RecipeError(f"train.resume_from={folder} is damaged: {'; '.join(problems)}; resume from an earlier "
                          "checkpoint-N (or auto), or start fresh in another train.output_dir")


def newest_whole(found: list[tuple[int, str]], output_dir: str) -> str | None:
    """train.resume_from=auto: the newest checkpoint whose files are whole (older ones after a warning naming what
    is damaged), None when there is none; RecipeError when every one is damaged (starting fresh would overwrite)."""
    skipped = []
    for _, path in reversed(found):
        problems = damaged(path)
        if not problems:
            if skipped and is_main_process():
                print(f"warning: {'; '.join(skipped)}; resuming from {path} instead", file=sys.stderr, flush=True)
            return path
        skipped.append(f"{path} is damaged ({', '.join(problems)})")
    if skipped:
        raise RecipeError(f"train.resume_from=auto: every checkpoint in {output_dir} is damaged ({'; '.join(skipped)})"
                          "; remove them, or start fresh in another train.output_dir")
    return None
