"""The training set: data.source read, tokenized and labelled, less the rows `eval.fraction` holds out.

Held out: the raw rows are grouped (stdlib_docs: by the module a question names, so no module has docstrings on both
sides; any other source: identical rows together), the groups shuffled with train.seed and taken while they fit
eval.fraction of the rows; the training set is built from the other rows only. The held-out rows (`HeldOut`) come in a
seeded random order and become an eval set in finetune/evaluation/sets.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from finetune.data.report import DataReport
from finetune.data.row_kinds import RowKind
from finetune.data.sources import Record
from finetune.data.streaming import stream_sft_dataset
from finetune.recipe import DataConfig, RecipeError

QUESTION_MODULE = re.compile(r"`([A-Za-z_]\w*)\.")  # stdlib_docs: "What does `json.dumps` do?" → json


def plain_json(value: Any) -> Any:
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
    text = json.dumps(record, sort_keys=True, default=plain_json, ensure_ascii=False)
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
