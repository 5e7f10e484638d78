"""A recipe's eval sets: rows held out of data.source (`eval.fraction`, finetune/data/training_set.py) or read from
`eval.source` / `eval.sets`; their micro-batches.

An eval row that equals a training row token for token (and image for image) is an error naming the key. Held-out
rows come in a seeded random order, so eval.limit takes a random subset of them; with eval.source it keeps the first
rows, as data.limit. Eval rows are read, tokenized and labelled as training rows are (data.format, data.max_length,
data.loss_on, …).

Eval micro-batches are formed here once, as the plan's eval batching says (the modes of data.batching), and handed to
the Trainer as a dataset whose items are whole micro-batches (eval batch size 1). Their count is padded to a multiple
of the ranks with a row without targets, so no rank repeats a real row and the eval loss is the exact token mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from finetune.core.labels import IGNORE_INDEX
from finetune.data.batching import MicroBatchCollator, MicroBatches, budget_groups, row_collator
from finetune.data.formats import form, rows_as_read
from finetune.data.report import DataReport
from finetune.data.row_kinds import RowKind
from finetune.data.sources import Record
from finetune.data.training_set import HeldOut, plain_json
from finetune.env import world_size
from finetune.recipe import Batching, DataConfig, EvalConfig, RecipeError, mixture_names


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
    text = json.dumps([list(ids), images], default=plain_json, sort_keys=True)
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
