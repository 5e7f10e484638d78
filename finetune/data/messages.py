"""A conversation's messages as chat templates take them, checked: roles and their order, each message's text, an
assistant turn's reasoning and tool calls (OpenAI's form: `tool_calls` with `content` "" or null), and a row's tool
schemas (`tools`). A row that does not fit is one BadRow naming the message and the field.

A conversation has the roles a chat format knows (system, user, assistant; tool roles where the template names them),
in the order chat models are trained on: an optional system turn first, then user and assistant alternating from a
user turn (a tool result only after an assistant turn, which answers it).
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from finetune.data.chat_spans import REASONING_FIELDS
from finetune.data.formats import check_text, string_field
from finetune.data.sources import BadRow

CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLES = ("tool", "ipython", "function")  # allowed where the chat template names them
# the roles each role may follow (None: the start); a tool role follows an assistant turn or another tool result
FOLLOWS = {"system": (None,), "user": (None, "system", "assistant"), "assistant": ("user", *TOOL_ROLES)}
CALL_SHAPE = "{type: function, function: {name, arguments}}"


def chat_roles(template: str) -> tuple[str, ...]:
    """The roles a conversation may have with this chat template's text: the tool roles it names, or `tool` where it
    renders tool calls and any role by its name (LFM2.5)."""
    named = tuple(r for r in TOOL_ROLES if f"'{r}'" in template or f'"{r}"' in template)
    if "tool" not in named and "tool_calls" in template:
        named = ("tool", *named)
    return CHAT_ROLES + named


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


def conversation_messages(value: Any, what: str) -> list[dict]:
    """A row's list of messages, each checked (`message`)."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"{what} is not a non-empty list of messages")
    return [message(m, f"{what}[{k}]") for k, m in enumerate(value)]


def message(value: Any, what: str) -> dict:
    """One message: a role and its text; an assistant turn with tool calls or reasoning may have empty content."""
    if not isinstance(value, dict) or "role" not in value:
        raise BadRow(f"{what} is not a {{role, content}} message")
    out = {key: v for key, v in value.items() if v is not None}  # parquet fills absent struct fields
    string_field(out.get("role"), f"{what}.role")
    carries = [name for name in (*REASONING_FIELDS, "tool_calls") if out.get(name) not in (None, "", [])]
    if out["role"] != "assistant" or not carries:
        if "content" not in out:
            raise BadRow(f"{what} is not a {{role, content}} message")
        out["content"] = string_field(out["content"], f"{what}.content")
        return out
    content = out.get("content", "")
    if not isinstance(content, str):
        raise BadRow(f"{what}.content is {type(content).__name__}, not a string")
    check_text(content, f"{what}.content")
    out["content"] = content
    for name in carries:
        field = f"{what}.{name}"
        out[name] = tool_calls(out[name], field) if name == "tool_calls" else string_field(out[name], field)
    return out


def tool_calls(value: Any, what: str) -> list[dict]:
    """An assistant turn's tool calls in the form transformers documents ({type, function: {name, arguments}},
    arguments an object): a flat {name, arguments} call and JSON-string arguments are read as that form."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"{what} is not a non-empty list of tool calls ({CALL_SHAPE})")
    out = []
    for j, call in enumerate(value):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise BadRow(f"{what}[{j}] has no function name; a tool call is {CALL_SHAPE}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json(arguments, f"{what}[{j}].function.arguments") if arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise BadRow(f"{what}[{j}].function.arguments is {type(arguments).__name__}, not an object of arguments")
        rest = {k: v for k, v in call.items() if k not in ("function", "name", "arguments")}
        out.append({"type": "function", **rest, "function": {**function, "arguments": arguments}})
    return out


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRow(f"{what} is not JSON ({e.msg} at character {e.pos + 1})") from None


def row_tools(record: Any, template: str) -> list[dict] | None:
    """A row's `tools` column (JSON schemas, or a JSON string of them) as the template's `tools=`; None without one.
    A template that never reads `tools` cannot show them: one BadRow, not tools silently left out."""
    value = record.get("tools") if isinstance(record, dict) else None
    if value is None or value in ("", []):
        return None
    if isinstance(value, str):
        value = _json(value, "tools")
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow("tools is not a list of tool schemas (JSON objects)")
    if "tools" not in template:
        raise BadRow(
            f"tools ({len(value)} schema{'s' if len(value) != 1 else ''}): the chat template never reads `tools`, so "
            "the model would not see them; give a template that renders tools (data.chat_template) or drop the column"
        )
    return value
