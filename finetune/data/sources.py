"""The raw rows of the recipe's `data.source`, each with where it came from, and the counts kept while loading.

Sources: `stdlib_docs` (built in, see finetune/data/stdlib_docs.py); a .jsonl/.json/.parquet/.csv file (.jsonl, .json
and .csv also as .gz) or a folder of them (sorted, hidden files skipped, other files named in the data line; a dangling
link, an unreadable file or a data file compressed otherwise is an error); otherwise a hub dataset id. `data.limit`
counts raw rows, bad ones included. A JSON object with a key twice is a bad row (JSON keeps the last); CSV cells stay
text (`007` is not 7), a CSV row with more or fewer cells than the header is a bad row. `DataReport` holds what
loading read, kept, dropped and skipped; `BadRow` is a row that cannot be used, and `reject_row` makes it one clear
error or a counted skip, per `data.on_bad_row`. The in-memory path (text.py), streaming (streaming.py) and image rows
(vision.py) all read and count through this module.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from finetune.data.report import DataReport
from finetune.data.source_files import file_kind, local_files
from finetune.recipe import DataConfig, RecipeError, first_line

Record = tuple[str, Any]  # (where: "file line 7", the raw row)


class BadRow(Exception):
    """A row that cannot be used: an error, or skipped and counted with data.on_bad_row=skip."""


def reject_row(data: DataConfig, report: DataReport, where: str, why: str) -> None:
    """A row that cannot be used: one error naming where and why, or (data.on_bad_row=skip) skipped and counted."""
    if data.on_bad_row == "error":
        raise RecipeError(f"{where}: {why} (data.on_bad_row=skip skips such rows)")
    report.bad_rows_skipped += 1
    if len(report.first_skipped) < 3:
        report.first_skipped.append(f"{where}: {why}")


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
            record = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except UnicodeDecodeError:
            reject_row(data, report, where, "not UTF-8")
            continue
        except json.JSONDecodeError as e:
            reject_row(data, report, where, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        except DuplicateKey as e:
            reject_row(data, report, where, str(e))
            continue
        yield where, record


class DuplicateKey(ValueError):
    pass


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: a key twice in one object is an error (json.loads would keep the last)."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKey(f"key '{key}' appears twice in one object (JSON would keep only the last); remove one")
    return found


def open_data(path: Path):
    """A data file opened for reading bytes, through gzip where its name ends in .gz."""
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")


def read_error(path: Path, error: Exception) -> RecipeError:
    why = getattr(error, "strerror", None) or (first_line(error))
    return RecipeError(f"{path}: cannot read it ({why}); check the file and its permissions")


def _text_lines(raw, path: Path) -> Iterator[str]:
    """A text file's lines, each decoded on its own, so a line that is not UTF-8 is named (a byte-order mark, as
    spreadsheets write one, is dropped)."""
    for number, line in enumerate(raw, 1):
        try:
            yield line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError:
            raise RecipeError(f"{path} line {number}: not UTF-8 text; save the file as UTF-8") from None


def csv_records(path: Path, data: DataConfig, report: DataReport) -> Iterator[Record]:
    """(where, {column: text}) per CSV row, up to data.limit: every cell stays text, as written; a row with more or
    fewer cells than the header is a bad row (data.on_bad_row)."""
    csv.field_size_limit(2**31 - 1)  # a long completion is one cell; rows are cut to data.max_length later
    with open_data(path) as raw:
        reader = csv.reader(_text_lines(raw, path))
        number = 0
        try:
            header = next(reader, None) or []
            twice = sorted({c for c in header if header.count(c) > 1})
            if twice:
                raise RecipeError(f"{path}: column '{twice[0]}' appears twice in the header; rename one")
            for cells in reader:
                if not any(cell.strip() for cell in cells):
                    continue  # a blank line
                if not _room(data, report, 1):
                    return
                number += 1
                report.rows_read += 1
                where = f"{path} row {number}"
                if len(cells) != len(header):
                    reject_row(
                        data,
                        report,
                        where,
                        f"{len(cells)} cells on line {reader.line_num} but the header has "
                        f"{len(header)} ({', '.join(header)}); a value holding a comma needs quotes",
                    )
                    continue
                yield where, dict(zip(header, cells))
        except csv.Error as e:
            raise RecipeError(f"{path} line {reader.line_num}: not valid CSV ({e})") from None
        except (OSError, EOFError) as e:
            raise read_error(path, e) from None


def _read_file(path: Path, data: DataConfig, report: DataReport, out: list[Record]) -> None:
    kind = file_kind(path)
    if kind == "csv":
        out.extend(csv_records(path, data, report))
        return
    if kind == "parquet":
        import datasets

        try:
            table = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as e:
            raise RecipeError(f"{path}: cannot read as {kind} ({first_line(e)})") from None
        return _take(table.select(range(_room(data, report, len(table)))).to_list(), f"{path} row", data, report, out)
    try:
        with open_data(path) as f:
            content = f.read()
    except (OSError, EOFError) as e:  # unreadable, or a .gz that is cut or not gzip
        raise read_error(path, e) from None
    if kind == "json" and content.lstrip().startswith(b"["):  # a JSON array; anything else is JSON lines
        try:
            items = json.loads(content.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except (UnicodeDecodeError, json.JSONDecodeError, DuplicateKey) as e:
            at = (
                f"line {e.lineno} column {e.colno}: {e.msg}"
                if isinstance(e, json.JSONDecodeError)
                else ("not UTF-8" if isinstance(e, UnicodeDecodeError) else str(e))
            )
            raise RecipeError(f"{path}: not a valid JSON array ({at})") from None
        return _take(items, f"{path} item", data, report, out)
    out.extend(json_line_records(path, content.splitlines(), data, report))


def read_records(data: DataConfig, report: DataReport) -> list[Record]:
    """The raw rows (the first data.limit of them), each with where it came from; bad JSON lines handled here."""
    source, out = data.source, []

    files = local_files(source, report)
    if files is not None:
        for file in files:
            if _room(data, report, 1):
                _read_file(file, data, report, out)
        return out
    import datasets

    try:
        table = datasets.load_dataset(source, split=data.split)
    except Exception as e:
        why = first_line(e)
        raise RecipeError(
            f"data.source={source}: neither a local path nor a reachable hub dataset (split {data.split}: {why})"
        ) from None
    rows = table.select(range(_room(data, report, len(table)))).to_list()
    _take(rows, f"{source} [{data.split}] row", data, report, out)
    return out
