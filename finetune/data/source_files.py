"""Which files `data.source` names: the built-in set's cached file, a data file, or a folder's data files (sorted,
hidden files skipped, other files recorded); None for a hub dataset id. Shared by reading (sources.py) and streaming
(streaming.py), so both refuse the same sources the same way."""

from __future__ import annotations

import os
from pathlib import Path

from finetune.data.report import DataReport
from finetune.recipe import RecipeError

FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
GZIP_KINDS = ("jsonl", "json", "csv")  # read through gzip when the name ends in .gz
COMPRESSED = (".gz", ".zst", ".bz2", ".xz", ".zip", ".lz4", ".7z")
PATH_SUFFIXES = set(FILE_KINDS) | {".txt", ".tsv", ".gz", ".zst", ".arrow", ".yaml", ".yml"}


def file_kind(path: Path) -> str | None:
    """jsonl | json | parquet | csv for a data file (also name.jsonl.gz, …), None for any other file."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz" and len(suffixes) > 1:
        kind = FILE_KINDS.get(suffixes[-2])
        return kind if kind in GZIP_KINDS else None
    return FILE_KINDS.get(suffixes[-1]) if suffixes else None


def looks_like_path(source: str) -> bool:
    return (
        Path(source).suffix.lower() in PATH_SUFFIXES
        or source.startswith(("/", "./", "../", "~"))
        or source.count("/") > 1
        or "\\" in source
    )


def folder_files(path: Path, source: str, report: DataReport | None = None) -> list[Path]:
    """The data files of a folder, sorted, hidden ones skipped; other files skipped and recorded in `report`. An entry
    that cannot be read is an error naming it: a link to nothing (or a loop), a file without read permission, a data
    file compressed in a way that is not read."""
    try:
        entries = sorted(
            p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    except OSError as e:
        raise RecipeError(
            f"data.source={source}: cannot list {e.filename or path} ({e.strerror}); check its permissions"
        ) from None
    files, others = [], []
    for p in entries:
        if p.is_symlink() and not p.exists():
            raise RecipeError(
                f"data.source={source}: {p} is a link to nothing ({os.readlink(p)}, or a loop); fix or remove it"
            )
        if p.is_dir():
            continue
        kind, suffixes = file_kind(p), [s.lower() for s in p.suffixes]
        if (
            kind is None
            and suffixes
            and suffixes[-1] in COMPRESSED
            and len(suffixes) > 1
            and suffixes[-2] in (FILE_KINDS)
        ):
            raise RecipeError(
                f"data.source={source}: {p} is compressed ({suffixes[-1]}), which is not read; "
                f"decompress it (gzip, .gz, is read for {', '.join(GZIP_KINDS)})"
            )
        if kind is None:
            others.append(str(p.relative_to(path)))
        elif not p.is_file() or not os.access(p, os.R_OK):
            raise RecipeError(f"data.source={source}: {p} cannot be read (not a regular file, or no read permission)")
        else:
            files.append(p)
    if not files:
        raise RecipeError(
            f"data.source={source}: folder holds no {'/'.join(FILE_KINDS)} files"
            + (f" (only {', '.join(others[:3])})" if others else "")
        )
    if report is not None:
        report.skipped_files = others
    return files


def local_files(source: str, report: DataReport | None = None) -> list[Path] | None:
    """The data files data.source names (stdlib_docs: the built-in set's cached file; a folder: its data files), or
    None for a hub dataset id. Shared by reading and streaming, so both refuse the same sources the same way."""
    if source == "stdlib_docs":
        from finetune.data.stdlib_docs import ensure_cached

        return [ensure_cached()]
    path = Path(source).expanduser()
    if path.is_dir():
        return folder_files(path, source, report)
    if path.is_file():
        if file_kind(path) is None:
            raise RecipeError(
                f"data.source={source}: unsupported file type; use {', '.join(FILE_KINDS)} (.jsonl, "
                ".json and .csv may be gzip-compressed: .gz)"
            )
        return [path]
    if path.is_symlink():
        raise RecipeError(
            f"data.source={source}: a link to nothing ({os.readlink(path)}, or a loop); fix the link or the path"
        )
    if looks_like_path(source):
        raise RecipeError(
            f"data.source={source}: no such file or folder; check the path (relative to "
            f"{Path.cwd()}), or give a hub dataset id or stdlib_docs"
        )
    return None
