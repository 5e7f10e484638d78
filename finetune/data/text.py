"""SFT rows from the recipe's `data:` section: check, render through the chat template, tokenize, label.

`load_sft_dataset(data, tokenizer)` returns a `datasets.Dataset` with `input_ids` and `labels` (-100 where there is
no loss; not shifted: labels[i] is the target token at position i, the trainer shifts) and a `DataReport`.

Rows come from finetune/data/sources.py (`stdlib_docs`, a file or folder, a hub dataset id). Forms read here:
`messages` ([{role, content}, …]), `prompt`/`completion` (strings, or lists of messages), `text`; ShareGPT and Alpaca
rows, and other columns, keys and role names, come to them through finetune/data/formats.py. Chat rows go through
`tokenizer.apply_chat_template`; the assistant spans come from prefix renderings (most templates have no
`{% generation %}` tags): for assistant turn i, messages[:i] with the generation prompt ends where the turn starts
and messages[:i+1] ends where it ends. The span keeps the end-of-turn token (e.g. `<|im_end|>`) but not the
whitespace the template puts after it, which the model never generates.

A conversation has the roles a chat format knows (system, user, assistant; tool roles where the template names them),
in the order chat models are trained on: an optional system turn first, then user and assistant alternating from a
user turn (a tool result only after an assistant turn). A text is cut before tokenizing where it is sure to exceed
data.max_length tokens (`char_limit`), so a huge row costs what a long one does; its first data.max_length tokens are
the same.
"""

from __future__ import annotations

import difflib
import functools
from typing import TYPE_CHECKING, Any

from finetune.core.labels import IGNORE_INDEX, target_count
from finetune.data.chat_templates import require_chat_template
from finetune.data.formats import as_read, check_columns, detect_format, form, string_field
from finetune.data.report import DataReport
from finetune.data.sources import BadRow, Record, read_records, reject_row
from finetune.recipe import DataConfig, RecipeError, first_line

CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLES = ("tool", "ipython", "function")  # allowed where the chat template names them
# the roles each role may follow (None: the start); a tool role follows an assistant turn or another tool result
FOLLOWS = {"system": (None,), "user": (None, "system", "assistant"), "assistant": ("user", *TOOL_ROLES)}

if TYPE_CHECKING:
    import datasets


# ---- rows to conversations or text ----


def chat_roles(tokenizer) -> tuple[str, ...]:
    """The roles a conversation may have with this tokenizer's chat template."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = " ".join(template.values()) if isinstance(template, dict) else str(template)
    return CHAT_ROLES + tuple(r for r in TOOL_ROLES if f"'{r}'" in template or f'"{r}"' in template)


def check_turns(messages: list[dict], roles: tuple[str, ...], what: str, remap: bool = False) -> None:
    """Known roles, in order: an optional system turn first, then user and assistant turns alternating from a user
    turn; a tool result follows an assistant turn (or another result) and is answered by the assistant. `remap`: an
    unknown role's message names data.roles (text rows read through formats.py)."""
    previous = None
    for k, message in enumerate(messages):
        role = message["role"]
        if role not in roles:
            guess = difflib.get_close_matches(role, roles, n=1)
            raise BadRow(
                f"{what}[{k}].role={role!r} is not a chat role ({', '.join(roles)})"
                + (f"; did you mean '{guess[0]}'?" if guess else "")
                + (
                    f"; data.roles={{{role}: ROLE}} maps it to one"
                    if remap and role not in CHAT_ROLES + TOOL_ROLES
                    else ""
                )
            )
        if previous not in FOLLOWS.get(role, ("assistant", *TOOL_ROLES)):
            raise BadRow(f"{what}[{k}] is {_order_problem(role, previous)}")
        previous = role


def _order_problem(role: str, previous: str | None) -> str:
    if role == previous:
        return f"a second {role} turn in a row; turns alternate user, assistant, user, … (merge the two)"
    if role == "assistant":
        return (
            "an assistant turn before any user turn; a conversation starts with a user turn (after an optional "
            "system turn)"
        )
    if role == "system":
        return "a system turn after the first turn; a system turn can only come first"
    after = f"a {previous} turn" if previous else "nothing"
    return f"a {role} turn after {after}; a tool result follows an assistant turn, and the assistant answers it"


def _messages(value: Any, what: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow(f"{what} is not a non-empty list of messages")
    out = []
    for k, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise BadRow(f"{what}[{k}] is not a {{role, content}} message")
        message = {key: v for key, v in message.items() if v is not None}  # parquet fills absent struct fields
        string_field(message.get("role"), f"{what}[{k}].role")
        message["content"] = string_field(message.get("content"), f"{what}[{k}].content")
        out.append(message)
    return out


def parse_row(fmt: str, record: Any, loss_on: str, roles: tuple[str, ...] = CHAT_ROLES) -> tuple[Any, list[int]]:
    """(text, []) for text rows; (messages, indices of the labelled turns) for chat rows, their roles checked."""
    check_columns(fmt, record)
    if fmt == "text":
        return string_field(record["text"], "text"), []
    if fmt == "messages":
        messages = _messages(record["messages"], "messages")
        first = 0
    else:
        prompt, completion = record["prompt"], record["completion"]
        prompt = (
            _messages(prompt, "prompt")
            if isinstance(prompt, list)
            else [{"role": "user", "content": string_field(prompt, "prompt")}]
        )
        completion = (
            _messages(completion, "completion")
            if isinstance(completion, list)
            else [{"role": "assistant", "content": string_field(completion, "completion")}]
        )
        messages, first = prompt + completion, len(prompt)  # the prompt is never a target
    check_turns(messages, roles, "messages" if fmt == "messages" else "prompt + completion", remap=True)
    turns = [i for i in range(first, len(messages)) if messages[i]["role"] == "assistant"]
    return messages, (turns[-1:] if loss_on == "completion" else turns)


# ---- tokenizing and labelling ----


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    require_chat_template(tokenizer)  # a base model: one error naming data.chat_template, not one per row
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja's raise_exception: e.g. roles that do not alternate
        why = first_line(e)
        raise BadRow(f"the chat template refuses it ({why})") from None


def _chat_labels(ids: list[int], prefix_ids: list[list[int]], turn_ids: list[list[int]], blank) -> list[int]:
    """Labels on each assistant span; `blank(token)`: whitespace only, trimmed from the span's end."""
    labels = [IGNORE_INDEX] * len(ids)
    for k, (prefix, turn) in enumerate(zip(prefix_ids, turn_ids), 1):
        start, end = len(prefix), len(turn)
        if ids[:start] != prefix or ids[:end] != turn or end <= start:
            raise BadRow(
                f"assistant turn {k}: the chat template does not render the conversation prefix-consistently "
                "(messages[:i] + generation prompt is not a token prefix of the whole conversation; a template that "
                "rewrites earlier turns, or content starting with whitespace that merges with the generation "
                "prompt); use data.loss_on=all or fix the template/data"
            )
        while end - 1 > start and blank(ids[end - 1]):
            end -= 1
        labels[start:end] = ids[start:end]
    return labels


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer) -> int:
    return max(map(len, tokenizer.get_vocab()), default=16)


def char_limit(tokenizer, max_length: int) -> int:
    """Characters past which a text has more than data.max_length tokens for sure: no token covers more characters
    than its vocabulary entry has; twice that, so the tokens before the cut are the same as without it."""
    return 2 * max_length * _longest_token(tokenizer)


def row_strings(
    fmt: str, record: Any, tokenizer, data: DataConfig, max_chars: int | None = None
) -> tuple[list[str], bool]:
    """(what to tokenize for one row of format `fmt` (formats.py: read as `form(fmt)`): the row, then per labelled
    assistant turn its two prefix renderings; whether a text was cut at `max_chars` first, which leaves the row longer
    than data.max_length all the same)."""
    loss_on = data.loss_on
    row, turns = parse_row(form(fmt), as_read(fmt, record, data), loss_on, chat_roles(tokenizer))
    if fmt == "text":
        return [row[:max_chars]], max_chars is not None and len(row) > max_chars
    if data.system_prompt is not None and row[0]["role"] != "system":  # the recipe's, not the template's default
        row, turns = [{"role": "system", "content": data.system_prompt}, *row], [i + 1 for i in turns]
    cut = next((i for i, m in enumerate(row) if max_chars is not None and len(m["content"]) > max_chars), None)
    if cut is not None:  # the turns after it would come after data.max_length tokens: cut away before rendering
        row = row[: cut + 1]
        row[cut]["content"] = row[cut]["content"][:max_chars]
        turns = [i for i in turns if i <= cut]
    turns = [] if loss_on == "all" else turns
    strings = (
        [render_chat(tokenizer, row, False)]
        + [render_chat(tokenizer, row[:i], True) for i in turns]
        + [render_chat(tokenizer, row[: i + 1], False) for i in turns]
    )
    return strings, cut is not None


def row_labels(
    fmt: str, loss_on: str, encoded: list[list[int]], blank, eos: int | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one row from its tokenized strings (row_strings); a text row ends with `eos` where
    given (data.text_eos) and the tokenizer did not add it."""
    ids = list(encoded[0])
    if fmt == "text" and eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    if fmt == "text" or loss_on == "all":
        return ids, list(ids)
    turns = (len(encoded) - 1) // 2
    return ids, _chat_labels(ids, encoded[1 : 1 + turns], encoded[1 + turns :], blank)


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


def blank_tokens(tokenizer):
    """token id → True if it decodes to whitespace only (trimmed from the end of assistant spans); cached."""
    return functools.lru_cache(maxsize=None)(lambda token: not tokenizer.decode([token]).strip())


def load_sft_dataset(
    data: DataConfig, tokenizer, records: list[Record] | None = None
) -> tuple[datasets.Dataset, DataReport]:
    """(datasets.Dataset with input_ids and labels, DataReport), from data.source or from `records` already read
    (finetune/data/training_set.py splits them into training and held-out rows)."""
    import datasets

    report = DataReport(source=data.source)
    if records is None:
        records = read_records(data, report)
    else:
        report.rows_read = len(records)
    if not records:
        skipped = f" ({report.bad_rows_skipped:,} bad rows skipped; data.on_bad_row=error names the first)"
        raise RecipeError(f"data.source={data.source}: no rows to read{skipped if report.bad_rows_skipped else ''}")
    fmt = report.format = detect_format(data.format, records, data.source, data.columns)
    rows, strings = [], []  # (where, first string, how many, cut); every string is tokenized in one batch call
    max_chars = char_limit(tokenizer, data.max_length)
    for where, record in records:
        try:
            texts, cut = row_strings(fmt, record, tokenizer, data, max_chars)
        except BadRow as e:
            reject_row(data, report, where, str(e))
            continue
        rows.append((where, len(strings), len(texts), cut))
        strings += texts
    encoded = tokenizer(strings, add_special_tokens=fmt == "text")["input_ids"] if strings else []
    blank = blank_tokens(tokenizer)
    columns: dict[str, list] = {"input_ids": [], "labels": []}
    for where, at, n, cut in rows:
        try:
            ids, labels = row_labels(fmt, data.loss_on, encoded[at : at + n], blank, text_eos(data, tokenizer))
        except BadRow as e:
            reject_row(data, report, where, str(e))
            continue
        kept = fit_row(data, report, where, ids, labels, cut)
        if kept:
            columns["input_ids"].append(kept[0])
            columns["labels"].append(kept[1])
    report.rows_kept = len(columns["input_ids"])
    if not report.rows_kept:
        raise RecipeError(f"data.source={data.source}: no rows left ({report.summary()})")
    return datasets.Dataset.from_dict(columns), report
