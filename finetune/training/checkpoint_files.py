"""Whether a checkpoint's files are whole, each damaged file named, before anything loads from it.

A checkpoint is renamed into place only once complete (checkpoints.save_atomically), but a file can still be cut or
damaged later (a copy that stopped, a full disk during `cp`, a bad sector). Every file's size is recorded in SIZES
just before the state file that marks the folder complete; at resume each file is checked against it, and by its kind
(finetune/model/files.py: JSON parses, safetensors and torch files are whole).
"""

from __future__ import annotations

import json
import os
import sys

from finetune.env import is_main_process
from finetune.model.files import folder_problems
from finetune.recipe import RecipeError

SIZES = "checkpoint_files.json"  # {file: bytes} of every file of the checkpoint


def record_sizes(folder: str) -> None:
    sizes = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, SIZES), "w") as f:
        json.dump(sizes, f, indent=1, sort_keys=True)


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
    if not isinstance(sizes, dict):
        problems[SIZES], sizes = "not a map of file sizes", {}
    for name, size in sizes.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems[name] = "missing"
        elif os.path.getsize(path) != size:
            problems[name] = f"{os.path.getsize(path):,} bytes, written as {size:,}"
    problems.update(folder_problems(folder, skip=(SIZES, *problems)))  # each file by its kind
    return [f"{name}: {why}" for name, why in sorted(problems.items())]


def check_whole(folder: str) -> None:
    """RecipeError naming every damaged file of the checkpoint train.resume_from names."""
    problems = damaged(folder)
    if problems:
        raise RecipeError(
            f"train.resume_from={folder} is damaged: {'; '.join(problems)}; resume from an earlier "
            "checkpoint-N (or auto), or start fresh in another train.output_dir"
        )


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
        raise RecipeError(
            f"train.resume_from=auto: every checkpoint in {output_dir} is damaged ({'; '.join(skipped)})"
            "; remove them, or start fresh in another train.output_dir"
        )
    return None
