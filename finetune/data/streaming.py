"""`data.streaming: true`: SFT rows read, tokenized and labelled one at a time, for data too large for memory.

Files are read line by line (jsonl), batch by batch (parquet) or row by row (csv); a hub id goes through
`datasets.load_dataset(..., streaming=True)`. Every row goes through the same functions as the in-memory path
(text.py: chat template, label spans, data.max_length/truncation; sources.py: data.on_bad_row),
so a streamed row is exactly the row `load_sft_dataset` would give. Streaming has no length up front: the run needs
`train.max_steps`, and the batching modes that sort or budget by length (length_grouped, token_budget, budgeted
packing) do not apply.

To the Trainer a stream is one pass that never ends: the source is read again and again (pass k shuffled by train.seed
and k), so an optimizer window never straddles an epoch end and the position of a checkpoint is global_step ×
accumulation micro-batches from the start, which a resumed run reads again and skips (the Trainer's own data skip;
tokenizing is far cheaper than training the same rows). Nothing is carried between micro-batches (packed rows are
packed within one micro-batch), so nothing else needs saving.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from finetune.data.formats import detect_format
from finetune.data.report import DataReport
from finetune.data.source_files import file_kind, local_files
from finetune.data.sources import BadRow, Record, csv_records, json_line_records, open_data, read_error, reject_row
from finetune.data.text import char_limit, encode, fit_row, row_labels, row_texts, text_eos
from finetune.recipe import DataConfig, RecipeError, first_line

PEEK_ROWS = 64  # rows read at start to detect the format and fail early on a wrong source
SHUFFLE_BUFFER = 1024  # rows shuffled together: a random order within a window of the stream, as streams do


def _file_records(path: Path, data: DataConfig, report: DataReport) -> Iterator[Record]:
    kind = file_kind(path)
    if kind in ("jsonl", "json"):
        try:
            with open_data(path) as f:
                if kind == "json" and f.read(64).lstrip().startswith(b"["):
                    raise RecipeError(
                        f"{path}: a JSON array cannot be streamed; write it as JSON lines (.jsonl) or set "
                        "data.streaming=false"
                    )
                f.seek(0)
                yield from json_line_records(path, f, data, report)
        except (OSError, EOFError) as e:  # unreadable, or a .gz that is cut or not gzip
            raise read_error(path, e) from None
        return
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:  # pyarrow's errors for a file that is not parquet (ArrowInvalid, OSError)
            raise RecipeError(f"{path}: cannot read as parquet ({first_line(e)})") from None
        rows = (row for batch in parquet.iter_batches(batch_size=1024) for row in batch.to_pylist())
        yield from _numbered(rows, path, report)
        return
    yield from csv_records(path, data, report)  # the in-memory path's reader: the same rows, the same errors


def _numbered(rows, path: Path, report: DataReport) -> Iterator[Record]:
    for number, row in enumerate(rows, 1):
        report.rows_read += 1
        yield f"{path} row {number}", row


def stream_records(data: DataConfig, report: DataReport) -> Iterator[Record]:
    """(where, raw row) for data.source, lazily, up to data.limit rows."""
    files = local_files(data.source)
    if files is None:
        records = _hub_records(data, report)
    else:
        records = itertools.chain.from_iterable(_file_records(f, data, report) for f in files)
    return itertools.islice(records, data.limit) if data.limit is not None else records


def _hub_records(data: DataConfig, report: DataReport) -> Iterator[Record]:
    import datasets

    try:
        table = datasets.load_dataset(data.source, split=data.split, streaming=True)
    except Exception as e:
        why = first_line(e)
        raise RecipeError(
            f"data.source={data.source}: neither a local path nor a reachable hub dataset (split {data.split}: {why})"
        ) from None
    yield from _numbered(table, f"{data.source} [{data.split}]", report)


class StreamingSFT(torch.utils.data.IterableDataset):
    """Yields {"input_ids", "labels"} rows as `load_sft_dataset` builds them; each epoch reads the source again.

    Under several dataloader workers each worker takes every n-th row, so no row is read twice.
    `endless`: pass after pass (what training reads: see the module).
    """

    def __init__(self, data: DataConfig, tokenizer, fmt: str, seed: int = 0, endless: bool = False):
        self.data, self.tokenizer, self.fmt, self.seed, self.endless = data, tokenizer, fmt, seed, endless
        self.epoch = 0
        self.report = DataReport(source=data.source, format=fmt)  # counts of the current pass

    def set_epoch(self, epoch: int) -> None:  # called by the Trainer's dataloader each epoch: a new order
        self.epoch = epoch

    def __iter__(self):
        """One pass (`endless`: pass after pass, never ending; see the module); stream_sft_dataset made sure a pass
        has rows."""
        passes = itertools.count(self.epoch) if self.endless else [self.epoch]
        for pass_index in passes:
            yield from self.shuffled(pass_index)

    def shuffled(self, pass_index: int):
        """One pass's rows in a buffered random order, deterministic in (seed, pass)."""
        rng = random.Random(self.seed * 100_003 + pass_index)
        buffer = []
        for row in self.rows():
            buffer.append(row)
            if len(buffer) == SHUFFLE_BUFFER:
                yield buffer.pop(rng.randrange(len(buffer)))
        rng.shuffle(buffer)
        yield from buffer

    def rows(self):
        """Rows in the source's order."""
        data, fmt = self.data, self.fmt
        self.report = report = DataReport(source=data.source, format=fmt)
        max_chars = char_limit(self.tokenizer, data.max_length)
        worker = torch.utils.data.get_worker_info()
        for k, (where, record) in enumerate(stream_records(data, report)):
            if worker is not None and k % worker.num_workers != worker.id:
                continue
            yield from self.labelled(where, record, max_chars)

    def labelled(self, where: str, record, max_chars: int):
        """The rows one record gives, labelled as load_sft_dataset labels them."""
        data, report = self.data, self.report
        try:
            pieces = row_texts(self.fmt, record, self.tokenizer, data, max_chars)
        except BadRow as e:
            reject_row(data, report, where, str(e))
            return
        for piece, ids, offsets in zip(pieces, *encode(self.tokenizer, pieces, self.fmt)):
            try:
                row = row_labels(piece, ids, offsets, text_eos(data, self.tokenizer))
            except BadRow as e:
                reject_row(data, report, where, str(e))
                continue
            report.count_turns(piece.located)
            if kept := fit_row(data, report, where, *row, piece.cut):
                report.rows_kept += 1
                yield {"input_ids": kept[0], "labels": kept[1]}


def stream_sft_dataset(
    data: DataConfig, tokenizer, seed: int = 0, endless: bool = False
) -> tuple[StreamingSFT, DataReport]:
    """The streamed dataset and a report of its first rows (the format; counts grow as training reads); `endless`:
    what training reads, pass after pass (see the module)."""
    report = DataReport(source=data.source, streamed=True)
    peek = list(itertools.islice(stream_records(data, report), PEEK_ROWS))
    if not peek:
        skipped = f" ({report.bad_rows_skipped:,} bad rows skipped; data.on_bad_row=error names the first)"
        raise RecipeError(f"data.source={data.source}: no rows to read{skipped if report.bad_rows_skipped else ''}")
    fmt = report.format = detect_format(data.format, peek, data.source, data.columns)
    dataset = StreamingSFT(data, tokenizer, fmt, seed, endless)
    if next(dataset.rows(), None) is None and len(peek) < PEEK_ROWS:
        raise RecipeError(f"data.source={data.source}: no rows left ({dataset.report.summary()})")
    return dataset, report
