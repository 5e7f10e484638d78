"""The raw rows of the recipe's `data.source`, each with where it came from, and the counts kept while loading.

Sources: `stdlib_docs` (built in, see finetune/data/stdlib_docs.py); a .jsonl/.json/.parquet/.csv file or a folder of
them (sorted, hidden files skipped); otherwise a hub dataset id. `data.limit` counts raw rows, bad ones included.
`DataReport` holds what loading read, kept, dropped and skipped; `BadRow` is a row that cannot be used, and
`reject_row` makes it one clear error or a counted skip, per `data.on_bad_row`. The in-memory path (text.py), streaming
(streaming.py) and image rows (vision.py) all read and count through this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.recipe import DataConfig, RecipeError

FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
PATH_SUFFIXES = set(FILE_KINDS) | {".txt", ".tsv", ".gz", ".zst", ".arrow", ".yaml", ".yml"}

Record = tuple[str, Any]  # (where: "file line 7", the raw row)


@dataclass
class DataReport:
    source: str = ""
    format: str = ""
    rows_read: int = 0
    rows_kept: int = 0
    truncated: int = 0
    dropped_over_length: int = 0
    dropped_no_supervised_tokens: int = 0
    bad_rows_skipped: int = 0
    tokens: int = 0  # input tokens over the kept rows
    target_tokens: int = 0  # supervised targets after the causal shift
    streamed: bool = False  # data.streaming: rows are read as training goes, counts unknown at start

    def summary(self) -> str:
        if self.streamed:
            return f"{self.source} ({self.format}), streamed: rows are read, tokenized and labelled as training goes"
        counts = [
            (self.truncated, "truncated"), (self.dropped_over_length, "dropped over data.max_length"),
            (self.dropped_no_supervised_tokens, "dropped without targets"), (self.bad_rows_skipped, "bad skipped"),
        ]
        extra = "".join(f", {n:,} {what}" for n, what in counts if n)
        return (
            f"{self.source} ({self.format}): {self.rows_kept:,} of {self.rows_read:,} rows kept{extra}; "
            f"{self.tokens:,} tokens, {self.target_tokens:,} targets"
        )


class BadRow(Exception):
    """A row that cannot be used: an error, or skipped and counted with data.on_bad_row=skip."""


def reject_row(data: DataConfig, report: DataReport, where: str, why: str) -> None:
    """A row that cannot be used: one error naming where and why, or (data.on_bad_row=skip) skipped and counted."""
    if data.on_bad_row == "error":
        raise RecipeError(f"{where}: {why} (data.on_bad_row=skip skips such rows)")
    report.bad_rows_skipped += 1


def looks_like_path(source: str) -> bool:
    return (
        Path(source).suffix.lower() in PATH_SUFFIXES or source.startswith(("/", "./", "../", "~"))
        or source.count("/") > 1 or "\\" in source
    )


def _room(data: DataConfig, report: DataReport, available: int) -> int:
    return available if data.limit is None else max(0, min(available, data.limit - report.rows_read))


def _take(items: list, label: str, data: DataConfig, report: DataReport, out: list[Record]) -> None:
    room = _room(data, report, len(items))
    report.rows_read += room
    out += [(f"{label} {k + 1}", item) for k, item in enumerate(items[:room])]


def json_line_records(path: Path, lines, data: DataConfig, report: DataReport):
    """(where, record) per non-empty JSON line of an iterable of byte lines, up to data.limit; bad lines per
    data.on_bad_row."""
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        if not _room(data, report, 1):
            return
        report.rows_read += 1
        where = f"{path} line {number}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            reject_row(data, report, where, "not UTF-8")
            continue
        except json.JSONDecodeError as e:
            reject_row(data, report, where, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        yield where, record


def _read_file(path: Path, data: DataConfig, report: DataReport, out: list[Record]) -> None:
    kind = FILE_KINDS[path.suffix.lower()]
    if kind in ("parquet", "csv"):
        import datasets

        try:
            table = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as e:
            raise RecipeError(f"{path}: cannot read as {kind} ({str(e).splitlines()[0] if str(e) else e!r})") from None
        return _take(table.select(range(_room(data, report, len(table)))).to_list(), f"{path} row", data, report, out)
    content = path.read_bytes()
    if kind == "json" and content.lstrip().startswith(b"["):  # a JSON array; anything else is JSON lines
        try:
            items = json.loads(content.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            at = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise RecipeError(f"{path}: not a valid JSON array ({at})") from None
        return _take(items, f"{path} item", data, report, out)
    out.extend(json_line_records(path, content.splitlines(), data, report))


def folder_files(path: Path, source: str) -> list[Path]:
    """The data files of a folder, sorted, hidden ones skipped."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_KINDS
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise RecipeError(f"data.source={source}: folder holds no {'/'.join(FILE_KINDS)} files")
    return files


def local_files(source: str) -> list[Path] | None:
    """The data files data.source names (stdlib_docs: the built-in set's cached file; a folder: its data files), or
    None for a hub dataset id. Shared by reading and streaming, so both refuse the same sources the same way."""
    if source == "stdlib_docs":
        from finetune.data.stdlib_docs import ensure_cached

        return [ensure_cached()]
    path = Path(source).expanduser()
    if path.is_dir():
        return folder_files(path, source)
    if path.is_file():
        if path.suffix.lower() not in FILE_KINDS:
            raise RecipeError(f"data.source={source}: unsupported file type; use {', '.join(FILE_KINDS)}")
        return [path]
    if looks_like_path(source):
        raise RecipeError(f"data.source={source}: no such file or folder; check the path (relative to "
                          f"{Path.cwd()}), or give a hub dataset id or stdlib_docs")
    return None


def read_records(data: DataConfig, report: DataReport) -> list[Record]:
    """The raw rows (the first data.limit of them), each with where it came from; bad JSON lines handled here."""
    source, out = data.source, []
    files = local_files(source)
    if files is not None:
        for file in files:
            if _room(data, report, 1):
                _read_file(file, data, report, out)
        return out
    import datasets

    try:
        table = datasets.load_dataset(source, split=data.split)
    except Exception as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RecipeError(
            f"data.source={source}: neither a local path nor a reachable hub dataset (split {data.split}: {why})"
        ) from None
    rows = table.select(range(_room(data, report, len(table)))).to_list()
    _take(rows, f"{source} [{data.split}] row", data, report, out)
    return out
