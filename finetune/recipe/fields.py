"""How a recipe key is declared (`one_of`, `number`, `mapping`, `setting`, `section`: its default, choices or bounds,
and its one-line description) and the error every recipe mistake becomes. `finetune/recipe/schema.py` declares
the keys with these; nothing here knows a key."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class RecipeError(ValueError):
    """A problem with the recipe or its inputs that the user can fix; printed as one line, exit code 2."""


def first_line(error: BaseException) -> str:
    """An exception worded for a user's one-line message: its first line, or its type's name when it has no text."""
    text = str(error)
    return text.splitlines()[0] if text.strip() else type(error).__name__


def one_of(*choices: str, default: str | None = None, help: str = "") -> Any:
    """A key whose value is one of `choices` (default: the first); `help`: its one-line description."""
    return field(default=choices[0] if default is None else default, metadata={"choices": choices, "help": help})


def number(
    default: Any = None,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    max_exclusive: bool = False,
    count: int | None = None,
    hint: str = "",
    help: str = "",
) -> Any:
    """A numeric key (or a list or map of numbers, each checked): finite, within [min, max] (or the open ends).
    `checks.check_numbers` checks every such key and words its message from these bounds; `count`: a list's length,
    `hint`: what the bound means, added to the message; `help`: the key's one-line description."""
    bounds = {
        "min": min,
        "max": max,
        "min_exclusive": min_exclusive,
        "max_exclusive": max_exclusive,
        "count": count,
        "hint": hint,
    }
    metadata = {"number": bounds, "help": help}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def setting(default: Any = None, *, help: str) -> Any:
    """Any other key, with its one-line description (`--help` prints it); a list or map default is copied per config."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(cls: type) -> Any:
    """A nested section (its description: the class docstring's first line)."""
    return field(default_factory=cls)


def mapping(keys: tuple[str, ...] = (), values: tuple[str, ...] = (), *, help: str) -> Any:
    """A map key (default empty) whose own keys, or values, are one of `keys` / `values` where given;
    `checks.check_mappings` checks every such key; `help`: its one-line description."""
    return field(default_factory=dict, metadata={"mapping": {"keys": keys, "values": values}, "help": help})
