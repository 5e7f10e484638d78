"""Each numeric key's own bounds (`schema.number`): checked generically over the whole config, and worded from the
bounds themselves ("must be in [0, 1)", "must be positive")."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any

from finetune.recipe.fields import RecipeError

COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _number_text(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def bounds_text(bounds: dict) -> str:
    """What a key's bounds (schema.number) ask, in words: positive, ≥ 0, in [0, 1), …"""
    low, high = bounds["min"], bounds["max"]
    if low is not None and high is not None:
        return (
            f"in {'(' if bounds['min_exclusive'] else '['}{_number_text(low)}, {_number_text(high)}"
            f"{')' if bounds['max_exclusive'] else ']'}"
        )
    if low is not None:
        if low == 0:
            return "positive" if bounds["min_exclusive"] else "≥ 0"
        return f"{'>' if bounds['min_exclusive'] else '≥'} {_number_text(low)}"
    if high is not None:
        return f"{'<' if bounds['max_exclusive'] else '≤'} {_number_text(high)}"
    return "a finite number"


def out_of_bounds(value: Any, bounds: dict) -> bool:
    """A number outside its bounds, NaN or ±inf; other values (None, auto) are for the cross-field checks."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value):
        return True
    low, high = bounds["min"], bounds["max"]
    below = low is not None and (value < low or (bounds["min_exclusive"] and value == low))
    return below or (high is not None and (value > high or (bounds["max_exclusive"] and value == high)))


def _check_finite(value: Any, key: str) -> None:
    """Open maps (model.config_overrides, …): their keys belong to the model, so only finiteness is known here."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{key}={value} is not a finite number; fix the value")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, item in items:
        _check_finite(item, f"{key}.{name}" if isinstance(value, dict) else f"{key}[{name}]")


def check_numbers(section: Any, prefix: str = "") -> None:
    """Every numeric key against the bounds the schema declares for it (schema.number), each number of a list or map
    key included; and every number in the open maps finite. The messages are worded from the bounds."""
    for f in fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        if is_dataclass(value):
            check_numbers(value, key + ".")
            continue
        bounds = f.metadata.get("number")
        if bounds is None:
            if isinstance(value, (dict, list)):
                _check_finite(value, key)
            continue
        hint = f" ({bounds['hint']})" if bounds["hint"] else ""
        if isinstance(value, list):
            count = bounds["count"]
            if (count is not None and len(value) != count) or any(out_of_bounds(v, bounds) for v in value):
                many = f"{COUNT_WORDS.get(count, count)} numbers" if count else "numbers"
                raise RecipeError(f"{key}={list(value)} must be {many} {bounds_text(bounds)}{hint}")
            continue
        for name, number in value.items() if isinstance(value, dict) else [(None, value)]:
            if out_of_bounds(number, bounds):
                where = key if name is None else f"{key}.{name}"
                verb = "must be"
                if not math.isfinite(number):
                    verb = f"is not {'a number' if math.isnan(number) else 'finite'}; it must be"
                raise RecipeError(f"{where}={number} {verb} {bounds_text(bounds)}{hint}")
