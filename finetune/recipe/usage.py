"""`--help` of every command, generated from the schema (finetune/recipe/schema.py), so it cannot go stale: the
command's usage line, its flags and own keys, then every section and its keys with type, bounds or choices, default
and the key's one-line `help=`. `--help SECTION` (`--help train`, `--help model.lora`) narrows it to one section."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from omegaconf import MISSING

from finetune.recipe.bounds import bounds_text
from finetune.recipe.data_schema import MixtureSource
from finetune.recipe.fields import RecipeError
from finetune.recipe.schema import Config

HELP_FLAGS = ("--help", "-h")


@dataclass(frozen=True)
class ToolKey:
    """A command's own `TOOL.NAME=VALUE` key (plan.headroom, verify.steps): not the recipe's."""

    name: str
    parse: Callable[[str], Any]  # int or float: what split_tool_args parses the value with
    default: str  # in words: some defaults depend on the machine or the recipe
    help: str


@dataclass(frozen=True)
class Command:
    name: str  # the console script
    summary: str  # one line: what it does
    also: tuple[str, ...] = ()  # other ways to run it
    flags: tuple[tuple[str, str], ...] = ()  # (flag, what it does), besides --help
    tool: str = ""  # the prefix of its own keys (plan, verify)
    keys: tuple[ToolKey, ...] = ()


@dataclass(frozen=True)
class Key:
    """One recipe key as --help shows it."""

    path: str
    type: str
    default: str
    help: str


def sections(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """{dotted section: its dataclass}, nested ones included (model.lora), data.mixture's entries as data.mixture[]."""
    found = {}
    for f in fields(cls):
        if is_dataclass(f.default_factory):
            found[prefix + f.name] = f.default_factory
            found.update(sections(f.default_factory, f"{prefix}{f.name}."))
        elif f.type == "list[MixtureSource]":
            found[f"{prefix}{f.name}[]"] = MixtureSource
    return found


def _default_text(value: Any) -> str:
    if value is MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(_default_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_default_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def _type_text(f) -> str:
    if "choices" in f.metadata:
        return " | ".join(f.metadata["choices"])
    kind = f.type.replace("list[MixtureSource]", "list of sources")
    if "number" in f.metadata:
        return f"{kind}, {bounds_text(f.metadata['number'])}"
    return kind


def keys(cls: type, prefix: str) -> list[Key]:
    """The leaf keys of one section (not its nested sections)."""
    found = []
    for f in fields(cls):
        if is_dataclass(f.default_factory):
            continue
        default = f.default_factory() if f.default is NO_DEFAULT else f.default
        found.append(Key(f"{prefix}{f.name}", _type_text(f), _default_text(default), f.metadata.get("help", "")))
    return found


def schema_keys() -> list[str]:
    """Every key --help lists (data.mixture's entry keys as data.mixture[].KEY)."""
    top = [k.path for k in keys(Config, "")]
    return top + [k.path for name, cls in sections().items() for k in keys(cls, f"{name}.")]


def _section_text(name: str, cls: type) -> list[str]:
    summary = (cls.__doc__ or "").strip().splitlines()[0]
    lines = [f"{name}: {summary}"]
    for key in keys(cls, f"{name}."):
        lines.append(f"  {key.path}: {key.type} = {key.default}")
        lines.append(f"      {key.help}")
    return lines


def _command_text(command: Command) -> list[str]:
    tool = f" [{command.tool}.KEY=VALUE …]" if command.keys else ""
    lines = [f"usage: {command.name} recipe=PATH|NAME [SECTION.KEY=VALUE …]{tool}"]
    lines += [f"       {other}" for other in command.also]
    lines += ["", command.summary, "", "options:"]
    flags = [
        ("recipe=PATH|NAME", "the recipe: a YAML file, or a built-in recipe's name (debug, quickstart, …)"),
        ("SECTION.KEY=VALUE", "override one key (YAML value), after the recipe, in order"),
        *command.flags,
        ("-h, --help [SECTION]", "this text; SECTION: only that section's keys"),
    ]
    width = max(len(flag) for flag, _ in flags)
    lines += [f"  {flag:<{width}}  {what}" for flag, what in flags]
    if command.keys:
        lines += ["", f"{command.tool}: this command's own keys"]
        for key in command.keys:
            lines += [f"  {command.tool}.{key.name}: {key.parse.__name__} = {key.default}", f"      {key.help}"]
    return lines


def help_text(command: Command, section: str | None = None) -> str:
    """The whole --help, or (`section`) the usage line and that section alone (its nested sections too)."""
    known = sections()
    if section is not None and section not in known and section != (command.tool or None):
        names = [*[n for n in known if "." not in n], *([command.tool] if command.tool else [])]
        raise RecipeError(f"--help {section}: no such section; one of {', '.join(names)}")
    lines = _command_text(command) if section in (None, command.tool) else [_command_text(command)[0]]
    if section == command.tool and section:
        return "\n".join(lines)
    if section is None:
        lines += ["", "recipe keys (defaults as in finetune/recipe/schema.py):", ""]
        lines += [f"  {k.path}: {k.type} = {k.default}\n      {k.help}" for k in keys(Config, "")]
    for name, cls in known.items():
        if section is None or name == section or name.startswith(f"{section}."):
            lines += ["", *_section_text(name, cls)]
    return "\n".join(lines)


def help_request(argv: list[str]) -> tuple[bool, str | None]:
    """(whether argv asks for help, the section asked for): `--help`, `-h`, `--help SECTION`, `--help=SECTION`."""
    for at, arg in enumerate(argv):
        if arg.startswith("--help="):
            return True, arg.partition("=")[2]
        if arg in HELP_FLAGS:
            after = argv[at + 1] if at + 1 < len(argv) else ""
            return True, after if after and "=" not in after and not after.startswith("-") else None
    return False, None


def help_asked(argv: list[str], command: Command) -> str | None:
    """The help text when argv asks for it, else None (RecipeError for a section that does not exist)."""
    asked, section = help_request(argv)
    return help_text(command, section) if asked else None


def print_page(text: str) -> None:
    """`text` on stdout; a reader that stops early (`| head`) ends it quietly, as it would end `cat`."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's flush at exit fails too
