"""SFT rows from the recipe's `data:` section: check, render through the chat template, tokenize, label.

`load_sft_dataset(data, tokenizer)` returns a `datasets.Dataset` with `input_ids` and `labels` (-100 where there is
no loss; not shifted: labels[i] is the target token at position i, the trainer shifts) and a `DataReport`.

Rows come from finetune/data/sources.py (`stdlib_docs`, a file or folder, a hub dataset id). Forms read here:
`messages` ([{role, content}, …], finetune/data/messages.py checks them: reasoning, tool calls, a `tools` column),
`prompt`/`completion` (strings, or lists of messages), `text`; ShareGPT and Alpaca rows, and other columns, keys and
role names, come to them through finetune/data/formats.py. Chat rows go through `tokenizer.apply_chat_template`,
rendered once as a whole (or once per assistant turn: data.turn_rows); the trained spans are found in that one
rendering (finetune/data/chat_labels.py, chat_spans.py): each assistant turn from its header's end to the token that
ends it, and every row is checked to train each assistant turn's text and nothing of the other messages'.

A text is cut before tokenizing where it is sure to exceed data.max_length tokens (`char_limit`), so a huge row costs
what a long one does; its first data.max_length tokens are the same.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.core.labels import target_count
from finetune.data.chat_labels import Offsets, check_labels, conversation_rows, render, template_text, token_labels
from finetune.data.chat_spans import Located
from finetune.data.chat_templates import require_chat_template
from finetune.data.formats import as_read, check_columns, detect_format, form, string_field
from finetune.data.messages import CHAT_ROLES, chat_roles, check_turns, conversation_messages, row_tools
from finetune.data.report import DataReport
from finetune.data.sources import BadRow, Record, read_records, reject_row
from finetune.recipe import DataConfig, RecipeError

if TYPE_CHECKING:
    import datasets


# ---- rows to conversations or text ----


def parse_row(fmt: str, record: Any, loss_on: str, roles: tuple[str, ...] = CHAT_ROLES) -> tuple[Any, list[int]]:
    """(text, []) for text rows; (messages, indices of the labelled turns) for chat rows, their roles checked
    (`roles`: those of the chat template)."""
    check_columns(fmt, record)
    if fmt == "text":
        return string_field(record["text"], "text"), []
    if fmt == "messages":
        messages = conversation_messages(record["messages"], "messages")
        first = 0
    else:
        prompt, completion = record["prompt"], record["completion"]
        prompt = (
            conversation_messages(prompt, "prompt")
            if isinstance(prompt, list)
            else [{"role": "user", "content": string_field(prompt, "prompt")}]
        )
        completion = (
            conversation_messages(completion, "completion")
            if isinstance(completion, list)
            else [{"role": "assistant", "content": string_field(completion, "completion")}]
        )
        messages, first = prompt + completion, len(prompt)  # the prompt is never a target
    what = "messages" if fmt == "messages" else "prompt + completion"
    check_turns(messages, roles, what, remap=True)
    turns = [i for i in range(first, len(messages)) if messages[i]["role"] == "assistant"]
    return messages, (turns[-1:] if loss_on == "completion" else turns)


# ---- rendering, tokenizing and labelling ----


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    require_chat_template(tokenizer)  # a base model: one error naming data.chat_template, not one per row
    return render(tokenizer, messages, generation_prompt=generation_prompt)


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer) -> int:
    return max(map(len, tokenizer.get_vocab()), default=16)


def char_limit(tokenizer, max_length: int) -> int:
    """Characters past which a text has more than data.max_length tokens for sure: no token covers more characters
    than its vocabulary entry has; twice that, so the tokens before the cut are the same as without it."""
    return 2 * max_length * _longest_token(tokenizer)


@dataclass
class RowText:
    """One training row before tokenizing: its text and, for assistant-only labels, where its turns lie (None: every
    token is a target); `cut`: a text was cut before rendering (char_limit)."""

    text: str
    located: Located | None = None
    cut: bool = False


def _cut_long(row: list[dict], turns: list[int], max_chars: int | None) -> tuple[list[dict], list[int], bool]:
    """A message longer than `max_chars` cut there, the turns after it left out: they would come after
    data.max_length tokens."""
    cut = next((i for i, m in enumerate(row) if max_chars is not None and len(m["content"]) > max_chars), None)
    if cut is None:
        return row, turns, False
    row = row[: cut + 1]
    row[cut] = {**row[cut], "content": row[cut]["content"][:max_chars]}
    return row, [i for i in turns if i <= cut], True


def row_texts(fmt: str, record: Any, tokenizer, data: DataConfig, max_chars: int | None = None) -> list[RowText]:
    """The training rows one record of format `fmt` gives (formats.py: read as `form(fmt)`): a text row as written;
    a chat row rendered whole, with its trained spans unless data.loss_on=all (per assistant turn under
    data.turn_rows=per_turn)."""
    record = as_read(fmt, record, data)
    if fmt == "text":
        text = parse_row(form(fmt), record, data.loss_on)[0]
        return [RowText(text[:max_chars], None, max_chars is not None and len(text) > max_chars)]
    require_chat_template(tokenizer)  # a base model: one error naming data.chat_template, not one per row
    template = template_text(tokenizer)
    row, turns = parse_row(form(fmt), record, data.loss_on, chat_roles(template))
    tools = row_tools(record, template)
    if data.system_prompt is not None and row[0]["role"] != "system":  # the recipe's, not the template's default
        row, turns = [{"role": "system", "content": data.system_prompt}, *row], [i + 1 for i in turns]
    row, turns, cut = _cut_long(row, turns, max_chars)
    if data.loss_on == "all":
        return [RowText(render(tokenizer, row, tools), None, cut)]
    if not turns:  # nothing to train on: dropped and counted
        text = render(tokenizer, row, tools)
        return [RowText(text, Located(text, []), cut)]
    return [
        RowText(located.text, located, cut)
        for located in conversation_rows(tokenizer, row, turns, data.turn_rows, tools)
    ]


def row_labels(piece: RowText, ids: list[int], offsets, eos: int | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one row from its tokens (and their character offsets); a text row ends with `eos` where
    given (data.text_eos) and the tokenizer did not add it; a chat row's labels are checked (chat_labels)."""
    ids = list(ids)
    if piece.located is None:
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids, list(ids)
    spans = Offsets(offsets)
    labels = token_labels(ids, spans, piece.located.trained)
    check_labels(piece.located, spans, labels)
    return ids, labels


def fit_row(data: DataConfig, report: DataReport, where: str, ids: list[int], labels: list[int], cut: bool = False):
    """(ids, labels) after data.max_length and data.truncation, or None (dropped and counted); `cut`: a text of the row
    was cut before tokenizing (row_strings), so it has more tokens than `ids`."""
    if len(ids) > data.max_length:
        if data.truncation == "error":
            raise RecipeError(
                f"{where}: {'more than ' if cut else ''}{len(ids)} tokens, longer than data.max_length="
                f"{data.max_length}; raise "
                "data.max_length or set data.truncation=right (cut) or drop"
            )
        if data.truncation == "drop":
            report.dropped_over_length += 1
            return None
        ids, labels = ids[: data.max_length], labels[: data.max_length]
        report.truncated += 1
    targets = target_count(labels)
    if not targets:
        report.dropped_no_supervised_tokens += 1
        return None
    report.tokens += len(ids)
    report.target_tokens += targets
    return ids, labels


def text_eos(data: DataConfig, tokenizer) -> int | None:
    """The token a text row ends with: the tokenizer's EOS under data.text_eos (None: the row as written)."""
    return tokenizer.eos_token_id if data.text_eos else None


def encode(tokenizer, pieces: list[RowText], fmt: str) -> tuple[list[list[int]], list]:
    """Every row's token ids (and, for chat rows, their character offsets) in one batch call."""
    if not pieces:
        return [], []
    texts = [p.text for p in pieces]
    if fmt == "text":
        return tokenizer(texts, add_special_tokens=True)["input_ids"], [None] * len(texts)
    try:
        out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise RecipeError(
            f"{type(tokenizer).__name__} gives no character offsets, which the chat labels need; load the model's "
            "fast tokenizer (its tokenizer.json)"
        ) from None
    return out["input_ids"], out["offset_mapping"]


def _other_rows(fmt: str, record: Any, tokenizer, data: DataConfig, max_chars: int | None, pieces) -> list[RowText]:
    """The rows the other data.turn_rows would give a conversation with several trained turns ([] where the two
    give the same rows), for the data line's comparison."""
    trained = sum(len(p.located.trained_turns) for p in pieces if p.located is not None)
    if fmt == "text" or data.loss_on != "assistant" or trained < 2 and data.turn_rows == "conversation":
        return []
    if data.turn_rows == "per_turn" and len(pieces) < 2:
        return []
    other = "per_turn" if data.turn_rows == "conversation" else "conversation"
    try:
        return row_texts(fmt, record, tokenizer, dataclasses.replace(data, turn_rows=other), max_chars)
    except BadRow:
        return []


def render_records(fmt: str, records: list[Record], tokenizer, data: DataConfig, report: DataReport):
    """(every training row's text, (where it came from, whether the other data.turn_rows differs for it) per row, the
    other data.turn_rows' rows where it differs); a record that does not fit is rejected (data.on_bad_row)."""
    pieces, owners, others = [], [], []
    max_chars = char_limit(tokenizer, data.max_length)
    for where, record in records:
        try:
            texts = row_texts(fmt, record, tokenizer, data, max_chars)
        except BadRow as e:
            reject_row(data, report, where, str(e))
            continue
        other = _other_rows(fmt, record, tokenizer, data, max_chars, texts)
        pieces += texts
        owners += [(where, bool(other))] * len(texts)
        others += other
    return pieces, owners, others


def label_rows(data: DataConfig, report: DataReport, pieces, owners, encoded, eos: int | None) -> dict[str, list]:
    """The kept rows' input_ids and labels (data.max_length applied, rows without targets dropped, counted)."""
    columns: dict[str, list] = {"input_ids": [], "labels": []}
    for (where, differs), piece, ids, offsets in zip(owners, pieces, *encoded):
        try:
            row = row_labels(piece, ids, offsets, eos)
        except BadRow as e:
            reject_row(data, report, where, str(e))
            continue
        report.count_turns(piece.located)
        if kept := fit_row(data, report, where, *row, piece.cut):
            columns["input_ids"].append(kept[0])
            columns["labels"].append(kept[1])
        if differs:
            report.count_rows("same", kept[1] if kept else None, data.max_length, data.truncation)
    report.rows_kept = len(columns["input_ids"])
    return columns


def count_other_rows(data: DataConfig, report: DataReport, others: list[RowText], encoded) -> None:
    """The other data.turn_rows' rows and targets, for the data line."""
    for piece, ids, offsets in zip(others, *encoded):
        try:
            report.count_rows("other", row_labels(piece, ids, offsets)[1], data.max_length, data.truncation)
        except BadRow:  # a row the other choice could not label is not one of its rows
            continue


def load_sft_dataset(
    data: DataConfig, tokenizer, records: list[Record] | None = None
) -> tuple[datasets.Dataset, DataReport]:
    """(datasets.Dataset with input_ids and labels, DataReport), from data.source or from `records` already read
    (finetune/data/training_set.py splits them into training and held-out rows)."""
    import datasets

    report = DataReport(source=data.source, turn_rows=data.turn_rows)
    if records is None:
        records = read_records(data, report)
    else:
        report.rows_read = len(records)
    if not records:
        skipped = f" ({report.bad_rows_skipped:,} bad rows skipped; data.on_bad_row=error names the first)"
        raise RecipeError(f"data.source={data.source}: no rows to read{skipped if report.bad_rows_skipped else ''}")
    fmt = report.format = detect_format(data.format, records, data.source, data.columns)
    pieces, owners, others = render_records(fmt, records, tokenizer, data, report)
    ids, offsets = encode(tokenizer, pieces + others, fmt)  # every row in one batch call
    n = len(pieces)
    columns = label_rows(data, report, pieces, owners, (ids[:n], offsets[:n]), text_eos(data, tokenizer))
    count_other_rows(data, report, others, (ids[n:], offsets[n:]))
    if not report.rows_kept:
        raise RecipeError(f"data.source={data.source}: no rows left ({report.summary()})")
    return datasets.Dataset.from_dict(columns), report
