"""Rows as they come: which format a data file's rows have, and each row in the form text.py labels.

Formats (`data.format`; auto takes the first whose columns the rows have): `messages` ([{role, content}, …]),
`sharegpt` (`conversations`: [{from, value}, …], roles human/user, gpt/assistant, system, tool/observation (a tool
result), function_call (the assistant calling a tool); an optional `system` column), `alpaca` (`instruction`,
optional `input`, `output`; optional `system` and `history`, a list of [instruction, output] pairs before it),
`prompt_completion` and `text`. ShareGPT and Alpaca rows become `messages` rows before anything renders them, so the
chat template and the assistant labels are what a messages row of the same conversation gets. Alpaca's input follows
its instruction after a newline (as LLaMA-Factory joins them); its history's answers are assistant turns like any.

Three map keys read other files without a conversion script (the conventions of LLaMA-Factory and axolotl):
`data.columns` ({field: your column}), `data.roles` ({your role: user | assistant | system | tool}) and
`data.message_keys` ({role: KEY, content: KEY}, a message's own keys). A row that does not fit is one BadRow naming
the field and the key that would read it; sources.reject_row adds the file and line.
"""

from __future__ import annotations

from typing import Any

from finetune.data.sources import BadRow, Record
from finetune.recipe import DataConfig, RecipeError

# the columns that make a row each format, in the order data.format=auto tries them
FORMAT_COLUMNS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
CONVERTED = ("sharegpt", "alpaca")  # become messages rows; the others are read as they are
MESSAGE_KEYS = {"messages": ("role", "content"), "sharegpt": ("from", "value")}  # a message's keys by default
MESSAGE_FIELD = {"messages": "messages", "sharegpt": "conversations"}
# ShareGPT's role names (LLaMA-Factory's too); data.roles adds to them
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",  # the assistant's turn that calls a tool
    "observation": "tool",  # the tool's result
    "tool": "tool",
}
COLUMNS_EXAMPLE = "data.columns={prompt: question, completion: answer}"


def form(fmt: str) -> str:
    """The form text.py reads rows of format `fmt` in: messages for ShareGPT and Alpaca, else the format itself."""
    return "messages" if fmt in CONVERTED else fmt


def string_field(value: Any, what: str) -> str:
    """A row's text field: a non-empty string that can be encoded."""
    if value is None or isinstance(value, str) and not value.strip():
        raise BadRow(f"{what} is empty")
    if not isinstance(value, str):
        raise BadRow(f"{what} is {type(value).__name__}, not a string")
    check_text(value, what)
    return value


def check_text(value: str, what: str) -> None:
    """A lone surrogate (a broken \\u escape in JSON) is not text: no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRow(
            f"{what} holds a lone surrogate ({value[e.start]!r} at character {e.start + 1}), which is not "
            "text (a broken \\u escape?); fix or remove it"
        ) from None


# ---- which format ----


def renamed(record: Any, columns: dict[str, str]) -> Any:
    """A row with data.columns applied: each mapped column read as its field."""
    if not columns or not isinstance(record, dict):
        return record
    out = {k: v for k, v in record.items() if k not in columns.values()}
    out.update({name: record[column] for name, column in columns.items() if column in record})
    return out


def detect_format(requested: str, records: list[Record], source: str, columns: dict[str, str] | None = None) -> str:
    """data.format, or (auto) the first format whose columns the rows have, after data.columns; else one error naming
    the columns found, the formats looked for and data.columns."""
    columns = columns or {}
    found = list(dict.fromkeys(k for _, r in records if isinstance(r, dict) for k in r))
    fields = list(dict.fromkeys(k for _, r in records if isinstance(r, dict) for k in renamed(r, columns)))
    absent = [f"data.columns.{name}={column}" for name, column in columns.items() if column not in found]
    unread = f"; no row has the column {absent[0].split('=')[1]} ({absent[0]})" if absent else ""
    candidates = FORMAT_COLUMNS if requested == "auto" else {requested: FORMAT_COLUMNS[requested]}
    for fmt, needed in candidates.items():
        if all(c in fields for c in needed):
            return fmt
    if requested == "auto":
        expected = "; ".join(" + ".join(c) + (f" ({f})" if f in CONVERTED else "") for f, c in candidates.items())
        fix = f"data.columns reads yours as these (e.g. {COLUMNS_EXAMPLE})"
    else:
        expected = " + ".join(FORMAT_COLUMNS[requested]) + f" (data.format={requested})"
        fix = f"data.columns={{{FORMAT_COLUMNS[requested][0]}: YOUR_COLUMN}} reads another column as it"
    raise RecipeError(
        f"data.source={source}: columns found: {', '.join(found) or 'none'}; expected {expected}{unread}; {fix}"
    )


# ---- each row in the form text.py reads ----


def check_columns(fmt: str, record: Any) -> None:
    """A row of format `fmt` is an object with that format's columns; BadRow names what is missing and the key that
    reads it from another column."""
    if not isinstance(record, dict):
        raise BadRow(f"a row is an object with {' + '.join(FORMAT_COLUMNS[fmt])}, not {type(record).__name__}")
    missing = [c for c in FORMAT_COLUMNS[fmt] if c not in record]
    if missing:
        raise BadRow(
            f"missing {', '.join(missing)} (row has: {', '.join(record) or 'nothing'}); data.columns="
            f"{{{missing[0]}: YOUR_COLUMN}} reads it from another column"
        )


def as_read(fmt: str, record: Any, data: DataConfig) -> Any:
    """One row in the form text.py reads (`form(fmt)`): data.columns applied; ShareGPT and Alpaca rows (and messages
    rows under data.roles or data.message_keys) as {"messages": [{role, content}, …]}. BadRow names the field and the
    key that would read it."""
    if fmt not in FORMAT_COLUMNS:  # messages+images: vision.py reads those rows
        return record
    record = renamed(record, data.columns)
    convert = fmt in CONVERTED or (fmt == "messages" and (data.roles or data.message_keys))
    if not convert:
        return record  # read as it is: text.parse_row checks it
    check_columns(fmt, record)
    if fmt == "alpaca":
        return {"messages": alpaca_messages(record)}
    messages = conversation(record[MESSAGE_FIELD[fmt]], fmt, data)
    if fmt == "sharegpt":
        system = _system_column(record)
        if system and messages[0]["role"] == "system":
            raise BadRow("a system column and a system turn (conversations[0]); keep one of them")
        messages = system + messages
    tools = {"tools": record["tools"]} if "tools" in record else {}  # the row's tool schemas go to the template
    return {"messages": messages, **tools}


def conversation(value: Any, fmt: str, data: DataConfig) -> list[dict]:
    """A list of messages (messages or ShareGPT conversations) as [{role, content}, …]: the keys data.message_keys
    names, role names through data.roles (and ShareGPT's own)."""
    what = MESSAGE_FIELD[fmt]
    role_key = data.message_keys.get("role", MESSAGE_KEYS[fmt][0])
    content_key = data.message_keys.get("content", MESSAGE_KEYS[fmt][1])
    names = {**SHAREGPT_ROLES, **data.roles} if fmt == "sharegpt" else data.roles
    if not isinstance(value, list) or not value:
        raise BadRow(f"{what} is not a non-empty list of messages")
    out = []
    for k, message in enumerate(value):
        shape = f"{{{role_key}, {content_key}}}"
        if not isinstance(message, dict):
            raise BadRow(f"{what}[{k}] is {type(message).__name__}, not a {shape} message")
        missing = next((key for key in (role_key, content_key) if key not in message), None)
        if missing:
            raise BadRow(
                f"{what}[{k}] has no '{missing}' (it has: {', '.join(message) or 'nothing'}); data.message_keys="
                f"{{role: KEY, content: KEY}} names the keys a message uses (here: {role_key}, {content_key})"
            )
        role = string_field(message[role_key], f"{what}[{k}].{role_key}")
        if fmt == "sharegpt" and role not in names:
            raise BadRow(
                f"{what}[{k}].{role_key}={role!r} is not a ShareGPT role ({', '.join(names)}); data.roles={{{role}: "
                "assistant} maps it (to user, assistant, system or tool)"
            )
        rest = {key: v for key, v in message.items() if key not in (role_key, content_key) and v is not None}
        content = string_field(message[content_key], f"{what}[{k}].{content_key}")
        out.append({**rest, "role": names.get(role, role), "content": content})
    return out


def _system_column(record: dict) -> list[dict]:
    """A ShareGPT or Alpaca row's `system` column as the conversation's first turn; empty or absent: none."""
    system = record.get("system")
    if system is None or isinstance(system, str) and not system.strip():
        return []
    return [{"role": "system", "content": string_field(system, "system")}]


def alpaca_messages(record: dict) -> list[dict]:
    """system, history's [instruction, output] pairs, then instruction (+ input) and output, as messages."""
    history = record.get("history") or []
    if not isinstance(history, list):
        raise BadRow(f"history is {type(history).__name__}, not a list of [instruction, output] pairs")
    messages = _system_column(record)
    for k, pair in enumerate(history):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadRow(f"history[{k}] is not an [instruction, output] pair (a list of two strings)")
        messages += [
            {"role": "user", "content": string_field(pair[0], f"history[{k}]'s instruction")},
            {"role": "assistant", "content": string_field(pair[1], f"history[{k}]'s output")},
        ]
    prompt = string_field(record["instruction"], "instruction")
    extra = record.get("input")
    if extra is not None and not (isinstance(extra, str) and not extra.strip()):
        prompt += "\n" + string_field(extra, "input")  # LLaMA-Factory's join
    output = string_field(record["output"], "output")
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def rows_as_read(fmt: str, records: list[Record], data: DataConfig) -> list[Record]:
    """`records` in the form text.py reads (`form(fmt)`), as the sample prompts take them; a row that does not
    convert is left out (loading has rejected or skipped it already)."""
    out = []
    for where, record in records:
        try:
            out.append((where, as_read(fmt, record, data)))
        except BadRow:
            continue
    return out
