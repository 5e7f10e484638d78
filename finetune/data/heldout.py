"""A recipe's eval set: rows held out of data.source (`eval.fraction`) or read from `eval.source`; its micro-batches.

Held out: the raw rows are grouped (stdlib_docs: by the module a question names, so no module has docstrings on both
sides; any other source: identical rows together), the groups shuffled with train.seed and taken while they fit
eval.fraction of the rows; the training set is built from the other rows only. Either way an eval row that equals a
training row token for token (and image for image) is an error naming the key. The held-out rows come in a seeded
random order, so eval.limit takes a random subset of them; with eval.source it keeps the first rows, as data.limit.
Eval rows are read, tokenized and labelled as training rows are (data.format, data.max_length, data.loss_on, …).

Eval micro-batches are formed here once, as `eval.batching` says (the modes of data.batching), and handed to the
Trainer as a dataset whose items are whole micro-batches (eval batch size 1). Their count is padded to a multiple of
the ranks with a row without targets, so no rank repeats a real row and the eval loss is the exact token mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.core.labels import IGNORE_INDEX
from finetune.data.batching import MicroBatchCollator, MicroBatches, budget_groups, row_collator
from finetune.data.formats import form, rows_as_read
from finetune.data.report import DataReport
from finetune.data.row_kinds import RowKind
from finetune.data.sources import Record
from finetune.data.streaming import stream_sft_dataset
from finetune.env import world_size
from finetune.recipe import Batching, DataConfig, EvalConfig, RecipeError, mixture_names

QUESTION_MODULE = re.compile(r"`([A-Za-z_]\w*)\.")  # stdlib_docs: "What does `json.dumps` do?" → json


@dataclass
class EvalSet:
    dataset: MicroBatches  # items are whole eval micro-batches
    collator: Callable
    records: list[Record]  # the eval rows as text.py reads them (formats.as_read): the sample prompts come from them
    format: str  # messages | prompt_completion | text | messages+images
    rows: int
    tokens: int  # real tokens of the eval rows (eval tokens/s)
    target_tokens: int
    summary: str  # the start-up line


# ---- held out of data.source ----


def _plain(value: Any) -> Any:
    """JSON for what json cannot write: bytes and images (PIL) by a digest of their content."""
    if isinstance(value, (bytes, bytearray)):
        return hashlib.sha256(value).hexdigest()
    if hasattr(value, "tobytes"):
        return [list(getattr(value, "size", ())), hashlib.sha256(value.tobytes()).hexdigest()]
    return repr(value)


def group_key(record: Any, source: str) -> str:
    """Rows with the same key are held out together: a stdlib module's rows, else identical rows."""
    if source == "stdlib_docs":
        with contextlib.suppress(KeyError, IndexError, TypeError):
            match = QUESTION_MODULE.search(record["messages"][0]["content"])
            if match:
                return f"module {match.group(1)}"
    text = json.dumps(record, sort_keys=True, default=_plain, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def split_records(
    records: list[Record], fraction: float, seed: int, source: str
) -> tuple[list[Record], list[Record], str]:
    """(training rows in source order, held-out rows in a seeded order, what was held out)."""
    groups: dict[str, list[int]] = {}
    for index, (_, record) in enumerate(records):
        groups.setdefault(group_key(record, source), []).append(index)
    target = round(fraction * len(records))
    if target < 1:
        raise RecipeError(
            f"eval.fraction={fraction:g} of the {len(records)} rows of data.source={source} holds out "
            "no row; raise eval.fraction (or data.limit)"
        )
    rng = random.Random(f"eval.fraction {seed}")
    order = sorted(groups)
    rng.shuffle(order)
    held: list[str] = []
    count = 0
    for key in order:
        if count + len(groups[key]) <= target:
            held.append(key)
            count += len(groups[key])
    if not held:  # every group is larger than the share: the smallest one
        held = [min(order, key=lambda k: len(groups[k]))]
    if len(held) == len(groups):
        raise RecipeError(
            f"eval.fraction={fraction:g} holds out every row of data.source={source} ({len(groups)} "
            "group(s) of rows that are held out together); lower eval.fraction or raise data.limit"
        )
    chosen = {i for key in held for i in groups[key]}
    held_out = [records[i] for i in sorted(chosen)]
    rng.shuffle(held_out)
    kind = "module" if source == "stdlib_docs" else "distinct row"
    how = (
        f"{len(chosen):,} row{'s' if len(chosen) != 1 else ''} ({len(held)} {kind}{'s' if len(held) != 1 else ''}) "
        f"held out of {source}"
    )
    return [r for i, r in enumerate(records) if i not in chosen], held_out, how


# ---- reading and checking the eval rows ----


def eval_reading(ev: EvalConfig, data: DataConfig, source: str, split: str) -> DataConfig:
    """The data keys the eval rows are read with: data.* (format, max_length, loss_on, …) with the eval set's source,
    split and limit, never streamed. How they are batched is the eval section's own (recipe.eval_batching)."""
    return dataclasses.replace(data, source=source, split=split, limit=ev.limit, streaming=False)


@contextlib.contextmanager
def named(key: str, source: str):
    """Errors met while reading the eval rows name the eval key that chose them, not data.source."""
    try:
        yield
    except RecipeError as e:
        text = str(e).replace(f"data.source={source}", key)
        raise RecipeError(text if key in text else f"{key}: {text}") from None


def row_digest(ids, images=None) -> str:
    text = json.dumps([list(ids), images], default=_plain, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def check_no_overlap(train, rows: list[dict], key: str) -> None:
    """No eval row equals a training row (tokens and images)."""
    images = train["images"] if "images" in train.column_names else [None] * len(train)
    seen = {row_digest(ids, im) for ids, im in zip(train["input_ids"], images)}
    both = sum(row_digest(r["input_ids"], r.get("images")) in seen for r in rows)
    if both:
        raise RecipeError(
            f"{key}: {both} of the {len(rows)} eval rows are also training rows (the same tokens); an "
            "eval row must never be trained on: remove them from one of the sets"
        )


# ---- micro-batches ----


def eval_groups(lengths: list[int], batching: Batching, seed: int) -> list[list[int]]:
    """Row indices per eval micro-batch, as training micro-batches are formed in the same mode."""
    if batching.budgeted:
        return budget_groups(lengths, batching.max_tokens, batching.counts_padding, seed)
    order = list(range(len(lengths)))
    if batching.groups_by_length:
        order.sort(key=lambda i: -lengths[i])
    micro = batching.rows_per_micro_batch
    return [order[k : k + micro] for k in range(0, len(order), micro)]


def pad_for_ranks(rows: list[dict], groups: list[list[int]], ranks: int) -> None:
    """Adds micro-batches of one row without targets until every rank gets as many: none repeats a real row."""
    missing = -len(groups) % ranks
    if missing:
        shortest = min(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
        rows.append({**rows[shortest], "labels": [IGNORE_INDEX] * len(rows[shortest]["labels"])})
        groups += [[len(rows) - 1] for _ in range(missing)]


# ---- the whole ----


@dataclass
class HeldOut:
    records: list[Record]  # in a seeded order
    how: str  # "N rows (M modules) held out of SOURCE"


def load_training_set(data: DataConfig, fraction: float, seed: int, tokenizer, rows: RowKind):
    """(the training dataset, its DataReport, the rows held out of it or None): data.source read, tokenized and
    labelled, less the share `fraction` (eval.fraction) held out. `tokenizer` is the processor of a VLM recipe."""
    if data.streaming:
        dataset, report = stream_sft_dataset(data, tokenizer, seed, endless=True)
        return dataset, report, None
    if not fraction:
        return (*rows.load(data, tokenizer), None)
    read = DataReport(source=data.source)
    records = rows.read(data, read)
    if not records:
        raise RecipeError(f"data.source={data.source}: no rows to read")
    train_records, held, how = split_records(records, fraction, seed, data.source)
    return (*rows.load(data, tokenizer, records=train_records), HeldOut(held, how))


@dataclass
class EvalRows:
    """The raw rows of one eval set and where they come from."""

    key: str  # the recipe key that chose them: errors name it
    source: str
    reading: DataConfig  # the data keys they are read with
    records: list[Record]
    how: str  # for the start-up line


def _read_eval_rows(ev: EvalConfig, data: DataConfig, key: str, source: str, rows: RowKind) -> EvalRows:
    reading = eval_reading(ev, data, source, ev.split)
    with named(key, source):
        read = DataReport(source=source)
        return EvalRows(key, source, reading, rows.read(reading, read), key)


def _held_rows(ev: EvalConfig, data: DataConfig, held: HeldOut, source: str) -> EvalRows:
    records = held.records[: ev.limit] if ev.limit is not None else held.records
    used = f" ({len(records):,} of them: eval.limit)" if ev.limit is not None else ""
    key = f"eval.fraction={ev.fraction:g}"
    return EvalRows(key, source, eval_reading(ev, data, source, data.split), records, held.how + used)


def eval_rows(ev: EvalConfig, data: DataConfig, held, names: list[str], rows: RowKind) -> dict[str, EvalRows]:
    """{name: its rows} of every eval set; one set without a name ("") unless the recipe names several
    (recipe.eval_set_names). `held`: rows held out of data.source (HeldOut), or of each mixture source by name."""
    found: dict[str, EvalRows] = {}
    if isinstance(held, dict):
        parts = {n: p.source for n, p in zip(mixture_names(data), data.mixture)}
        found.update({name: _held_rows(ev, data, h, parts[name]) for name, h in held.items()})
    elif held is not None:
        found["heldout"] = _held_rows(ev, data, held, data.source)
    if ev.source:
        found["eval"] = _read_eval_rows(ev, data, f"eval.source={ev.source}", ev.source, rows)
    for name, source in ev.sets.items():
        found[name] = _read_eval_rows(ev, data, f"eval.sets.{name}={source}", source, rows)
    return found if names else {"": next(iter(found.values()))}


def load_eval_sets(
    ev: EvalConfig,
    batching: Batching,
    data: DataConfig,
    held,
    names: tuple[str, ...],
    training,
    seed: int,
    tokenizer,
    rows: RowKind,
):
    """{name: EvalSet} of the recipe's eval sets ("" for its one unnamed set), each read as training rows are,
    checked against the `training` dataset, batched as the plan says (`batching`)."""
    return {
        name: load_eval_set(found, ev, batching, training, seed, tokenizer, rows, name)
        for name, found in eval_rows(ev, data, held, list(names), rows).items()
    }


def load_eval_set(
    rows_of: EvalRows, ev: EvalConfig, batching: Batching, training, seed: int, tokenizer, rows: RowKind, name: str = ""
):
    """One eval set: its rows read as training rows are, checked against the `training` dataset (None: a stream,
    not known up front), batched as the eval section says."""
    key, source, config, records = rows_of.key, rows_of.source, rows_of.reading, rows_of.records
    with named(key, source):
        if not records:
            raise RecipeError(f"data.source={source}: no rows to read")
        held_rows, eval_report = rows.load(config, tokenizer, records=records)
    items = held_rows.to_list()
    if training is not None:  # a stream is not known up front
        check_no_overlap(training, items, key)
    lengths = [len(r["input_ids"]) for r in items]
    groups = eval_groups(lengths, batching, seed)
    count = len(groups)
    pad_for_ranks(items, groups, world_size())
    collator = rows.collator(MicroBatchCollator(row_collator(batching, rows.text_tokenizer(tokenizer))), tokenizer)
    when = (f"every {ev.every_steps} optimizer steps, " if ev.every_steps else "") + "before the first step, at the end"
    summary = (
        f"eval{' ' + name if name else ''}: {rows_of.how}; {eval_report.summary()}; {count} {ev.batching} micro-batch"
        f"{'es' if count != 1 else ''}; {when}"
    )
    dataset = MicroBatches(items, groups)
    return EvalSet(
        dataset,
        collator,
        rows_as_read(eval_report.format, records, config),  # ShareGPT, Alpaca, data.columns: as text.py reads them
        form(eval_report.format),
        eval_report.rows_kept,
        sum(lengths),
        eval_report.target_tokens,
        summary,
    )
