"""The user-facing pages (README.md, docs/, accelerate_configs/README.md and the recipes' comments) say what the code
does, where a machine can check it: every relative link reaches a file (and a heading, for `#anchor`), every recipe key
written `section.key` exists in the schema (or is a command's own key, `verify.steps`), every default a page states
in the forms `` `KEY` (default `VALUE`) `` or `` `KEY: VALUE` (the default) `` is the schema's (the recipes reference
states no default in any other form), and the printed output shown after a `--dry-run` or `--help` command is what
that command prints now (lines shown in order; `…` elides lines, or text within a line). Read from the files, in this
process, no network."""

from __future__ import annotations

import re
import shlex
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import pytest
import yaml

from finetune.recipe.schema import CHOICES, OPEN_DICTS, Config
from finetune.recipe.usage import sections
from finetune.tools import plan, train, verify
from tests.launch import call

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "accelerate_configs" / "README.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda path: str(path),
)
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
FENCE = re.compile(r"^ {0,3}(```|~~~)")
# a file name, not a key: `model.safetensors`, `recipe.yaml`, `train.jsonl`
FILE_SUFFIXES = {"safetensors", "yaml", "yml", "json", "jsonl", "csv", "parquet", "py", "md", "pt", "bin", "gguf"}
TOOL_KEYS = {f"{c.tool}.{key.name}" for c in (plan.COMMAND, verify.COMMAND) for key in c.keys}
TOOL_SECTIONS = {c.tool for c in (plan.COMMAND, verify.COMMAND)}
# the commands whose printed pages a doc may show, and the module `tests.launch.call` runs for each
COMMANDS = {
    "finetune-train": "finetune/train.py",
    "finetune/train.py": "finetune/train.py",
    "finetune-plan": "finetune.plan",
    "finetune.plan": "finetune.plan",
    "finetune-verify": "finetune.verify",
    "finetune.verify": "finetune.verify",
}
PRINTS_ONLY = ("--dry-run", "--help", "-h")  # flags that print and exit: nothing trains
assert train.COMMAND.name == "finetune-train"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------------------------------
# reading the pages


def prose_lines(text: str) -> list[str]:
    """The page's lines with fenced code blocks blanked (their links and keys are not the page's): line numbers kept."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return lines


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number of the opening fence, the heading above it, the block's lines) for each fenced block."""
    blocks, inside, heading = [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if inside is None and line.startswith("#"):
            heading = line
        if FENCE.match(line):
            if inside is None:
                inside = (number, heading, [])
            else:
                blocks.append(inside)
                inside = None
        elif inside is not None:
            inside[2].append(line)
    return blocks


def code_spans(text: str) -> list[str]:
    """The inline code spans of a page's prose (`…`), each as written between its backticks."""
    prose = "\n".join(prose_lines(text))
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)


def recipe_comments(path: Path) -> list[str]:
    """The comments of a recipe: what follows `#` on each line (the YAML itself is checked when it loads)."""
    return [line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in the heading: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in prose_lines(page.read_text()):
        if (heading := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)) is not None:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


# ---------------------------------------------------------------------------------------------------------------------
# 1. links


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of each `[text](target)` in the page's prose whose target is a path in this repository."""
    found = []
    for number, line in enumerate(prose_lines(page.read_text()), 1):
        line = re.sub(r"`[^`]*`", "", line)  # a link inside a code span is text
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not a file here
                found.append((number, target))
    return found


def broken_link(page: Path, target: str) -> str | None:
    path_part, _, anchor = target.partition("#")
    destination = (page.parent / path_part).resolve() if path_part else page
    if not destination.exists():
        return f"{path_part}: no such file"
    if not destination.is_relative_to(ROOT):
        return f"{path_part}: outside the repository"
    if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
        return f"#{anchor}: no such heading in {rel(destination)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    broken = [
        f"{rel(page)}:{number}: ({target}) {why}"
        for number, target in relative_links(page)
        if (why := broken_link(page, target)) is not None
    ]
    assert broken == []


def test_the_link_check_can_fail(tmp_path):
    page = ROOT / "docs" / "commands.md"
    assert broken_link(page, "runs.md#preemption-containers-and-schedulers") is None
    assert broken_link(page, "runs.md#no-such-heading") is not None
    assert broken_link(page, "no-such-page.md") is not None
    assert slug("Training throughput against the peers: `scripts/benchmark.py`") == (
        "training-throughput-against-the-peers-scriptsbenchmarkpy"
    )


# ---------------------------------------------------------------------------------------------------------------------
# 2. recipe keys


def schema_paths(cls: type = Config, prefix: str = "") -> dict[str, object]:
    """{dotted key: its default} for every key, and every section as a key of its own (`model.lora`)."""
    found: dict[str, object] = {}
    for f in fields(cls):
        path = f"{prefix}{f.name}"
        if is_dataclass(f.default_factory):
            found[path] = None
            found.update(schema_paths(f.default_factory, f"{path}."))
        else:
            found[path] = f.default_factory() if f.default is MISSING else f.default
    return found


SCHEMA = schema_paths()
SECTIONS = {name.removesuffix("[]") for name in sections()} | {f.name for f in fields(Config)}
TOP = {f.name for f in fields(Config) if is_dataclass(f.default_factory)} | TOOL_SECTIONS


def module_names() -> set[str]:
    """The module-name prefixes the shipped recipes name (model.freeze, optim.lr_multipliers): `model.visual.merger`
    written in a recipe's comment is a module, not a key."""
    names = set()
    for path in RECIPES:
        recipe = yaml.safe_load(path.read_text())
        names.update(recipe.get("model", {}).get("freeze", []))
        names.update(recipe.get("optim", {}).get("lr_multipliers", {}))
    for comment in (c for path in RECIPES for c in recipe_comments(path)):  # the overrides a header shows
        for value in re.findall(r"(?:model\.freeze|optim\.lr_multipliers)=(\S+(?: \S+\})?)", comment):
            names.update(re.findall(r"[\w.]+(?=[,\]:])", value))
    return names


def without_values(text: str) -> str:
    """`KEY=VALUE` with its value removed (up to a space outside brackets): a value may name modules, not keys."""
    out, depth, skipping = [], 0, False
    for char in text:
        if char == "=" and depth == 0:
            out.append(char)
            skipping = True
            continue
        if skipping:
            depth += char in "[{(" or 0
            depth -= char in "]})" or 0
            if depth <= 0 and char.isspace():
                skipping, depth = False, 0
                out.append(char)
            continue
        out.append(char)
    return "".join(out)


def key_candidates(text: str) -> list[str]:
    """Every `section.key` written in `text` (a key with `*` or `[]`: a wildcard over that section)."""
    sections_ = "|".join(sorted(TOP))
    pattern = rf"(?<![\w./<-])((?:{sections_})\.[A-Za-z_*][\w.*]*(?:\[\])?)"
    found = []
    for candidate in re.findall(pattern, without_values(text)):
        candidate = candidate.rstrip(".")
        if candidate.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
            found.append(candidate)
    return found


def known_key(key: str, modules: set[str]) -> bool:
    if key in SCHEMA or key in TOOL_KEYS or key in modules:
        return True
    if key.endswith(".*"):  # `data.*`, `model.lora.*`, `verify.*`: a section
        return key[:-2] in SECTIONS or key[:-2] in TOOL_SECTIONS
    if key.endswith("[]"):
        return key in sections()
    if re.fullmatch(r"data\.mixture\[\]\.\w+", key):
        return key[len("data.mixture[].") :] in {f.name for f in fields(sections()["data.mixture[]"])}
    return any(key.startswith(f"{open_dict}.") for open_dict in OPEN_DICTS)  # `data.roles.bot`: a map's own key


def misspelt_on_purpose(span: str, text: str) -> bool:
    """The reference's example of the error a typo gets: `train.micro_bach_size` → "did you mean …"."""
    return re.search(re.escape(f"`{span}`") + r" → \"did you mean", text) is not None


@pytest.mark.parametrize("path", PAGES + RECIPES, ids=rel)
def test_every_recipe_key_a_page_names_exists(path):
    modules, text = module_names(), path.read_text()
    if path.suffix == ".md":
        spans = [span for span in code_spans(text) if not misspelt_on_purpose(span, text)]
    else:
        spans = recipe_comments(path)
    unknown = sorted({key for span in spans for key in key_candidates(span) if not known_key(key, modules)})
    assert unknown == [], f"{rel(path)} names keys the schema lacks"


def test_the_key_check_can_fail():
    modules = module_names()
    assert "model.visual.merger" in modules and "model.vision_tower" in modules
    assert key_candidates("train.micro_bach_size=8 model.freeze=[model.vision_model]") == [
        "train.micro_bach_size",
        "model.freeze",
    ]
    assert key_candidates("checkpoint-N/model.safetensors, recipe.yaml") == []
    assert not known_key("train.micro_bach_size", modules)
    assert not known_key("model.lora.rank", modules) and known_key("model.lora.r", modules)
    assert known_key("model.quantization.bits", modules) and known_key("verify.tolerance", modules)
    assert known_key("data.roles.bot", modules) and not known_key("verify.step", modules)


# ---------------------------------------------------------------------------------------------------------------------
# 3. stated defaults

KEY = r"[a-z_]+(?:\.[a-z_0-9]+)+"
STATED_DEFAULT = (
    # `KEY` (default `VALUE`, or later in the same parenthesis: `KEY` (`a|b`; default `a`
    re.compile(rf"`(?P<key>{KEY})`\s+\([^()]*?\bdefault `(?P<value>[^`]+)`"),
    re.compile(rf"`(?P<key>{KEY})(?::|=) ?(?P<value>[^`]+)`\s+\((?:the )?default\b"),  # `KEY: VALUE` (the default
)
REFERENCE = ROOT / "docs" / "recipes-reference.md"


def stated_defaults(text: str) -> list[tuple[str, str, int, int]]:
    """(key, value as written, start, end) of each default stated in one of the checked forms."""
    prose = "\n".join(prose_lines(text))
    return [(m["key"], m["value"], m.start(), m.end()) for form in STATED_DEFAULT for m in form.finditer(prose)]


def same_value(written: str, default: object) -> bool:
    """A value as a page writes it (YAML, as a recipe would) equals the schema's default."""
    parsed = yaml.safe_load(written)
    return parsed == default or written == str(default)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_default_a_page_states_is_the_schemas(page):
    wrong = [
        f"{key}: the page says {value}, the schema {SCHEMA[key]!r}" if key in SCHEMA else f"{key}: no such key"
        for key, value, _, _ in stated_defaults(page.read_text())
        if key not in SCHEMA or not same_value(value, SCHEMA[key])
    ]
    assert wrong == []


def test_the_recipes_reference_states_defaults_only_in_the_checked_forms():
    """Each "default" in the reference is one checked statement (or the page pointing to the schema's defaults)."""
    text = "\n".join(prose_lines(REFERENCE.read_text()))
    checked = [(start, end) for _, _, start, end in stated_defaults(text)]
    loose = [
        text[max(0, m.start() - 60) : m.end() + 20].replace("\n", " ")
        for m in re.finditer(r"\bdefaults?\b", text, flags=re.I)
        if not any(start <= m.start() < end for start, end in checked)
        and not text[m.start() - 11 : m.end()].endswith("their defaults")
    ]
    assert loose == []


# `KEY` (`a|b|c` or `KEY` (`a`, `b`, `c`: the values listed first in the key's parenthesis
CHOICE_LIST = re.compile(
    rf"`(?P<key>{KEY})`\s+\((?P<values>`[\w.-]+(?:\|[\w.-]+)+`|`[\w.-]+`(?:(?:, | or |\|)`[\w.-]+`)+)"
)


def listed_choices(text: str) -> list[tuple[str, list[str]]]:
    """(key, values) of each `` `KEY` (`a|b|c` `` a page writes for a key that takes one of its choices."""
    prose = "\n".join(prose_lines(text))
    found = CHOICE_LIST.finditer(prose)
    return [(m["key"], re.findall(r"[\w.-]+", m["values"])) for m in found if m["key"] in CHOICES]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_choice_a_page_lists_is_the_schemas(page):
    """`KEY` (`a|b|c`): each value one of the key's choices; in the recipes reference, every choice."""
    wrong = [
        f"{key}: {'|'.join(values)} (the schema: {'|'.join(CHOICES[key])})"
        for key, values in listed_choices(page.read_text())
        if not set(values) <= set(CHOICES[key]) or (page == REFERENCE and set(values) != set(CHOICES[key]))
    ]
    assert wrong == []


def test_the_default_check_can_fail():
    ((key, value, _, _),) = stated_defaults("`eval.batching` (default `padded`; …)")
    assert key == "eval.batching" and not same_value(value, SCHEMA[key])
    ((key, value, _, _),) = stated_defaults("`data.format` (`auto|text`; default `text`)")
    assert key == "data.format" and not same_value(value, SCHEMA[key])
    assert stated_defaults("`data.format` (see (the rows); default `auto`)") == []  # another parenthesis: not bound
    ((key, value, _, _),) = stated_defaults("`train.precision: fp32` (the default)")
    assert same_value(value, SCHEMA[key])
    assert same_value("false", SCHEMA["model.trust_remote_code"]) and same_value("0", SCHEMA["eval.fraction"])
    assert listed_choices("`data.format` (`messages|prompt_completion|text`)") == [
        ("data.format", ["messages", "prompt_completion", "text"])
    ]
    assert listed_choices("`data.format` (`messages`, `prompt_completion`, `text`), …") == [
        ("data.format", ["messages", "prompt_completion", "text"])
    ]
    assert listed_choices("`data.source` (`stdlib_docs`, `shapes_captions`)") == []  # no choices: any source


# ---------------------------------------------------------------------------------------------------------------------
# 4. the printed pages a doc shows


def shown_command(block: list[str]) -> tuple[str, list[str]] | None:
    """(module, argv) of a block that runs one command that only prints (`--dry-run`, `--help`), else None."""
    lines = [line for line in block if line.strip() and not line.lstrip().startswith("#")]
    if len(lines) != 1:
        return None
    words = shlex.split(lines[0].split(" > ", 1)[0], comments=True)
    at = next((i for i, word in enumerate(words) if word in COMMANDS), None)
    if at is None or not any(word in PRINTS_ONLY for word in words):
        return None
    return COMMANDS[words[at]], words[at + 1 :]


def shown_outputs() -> list[tuple[str, str, list[str], list[str]]]:
    """(where, module, argv, the lines shown) for each printing command a page shows with its output: the next fenced
    block under the same heading."""
    found = []
    for page in PAGES:
        blocks = fenced_blocks(page.read_text())
        for (number, heading, block), following in zip(blocks, [*blocks[1:], None]):
            if (command := shown_command(block)) is not None and following and following[1] == heading:
                found.append((f"{rel(page)}:{number}", *command, following[2]))
    return found


def line_pattern(shown: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in shown.split("…")))


def matches(shown: list[str], printed: list[str]) -> bool:
    """`shown` is `printed` with elisions: a line `…` stands for any lines (none included), `…` in a line for any
    text; without a leading (trailing) `…` line the shown lines start (end) where the printed ones do."""
    groups: list[list[re.Pattern]] = [[]]
    for line in shown:
        if line.strip() == "…":
            groups.append([])
        else:
            groups[-1].append(line_pattern(line.rstrip()))
    free_start, free_end = not groups[0], not groups[-1]
    groups = [group for group in groups if group]
    printed = [line.rstrip() for line in printed]

    def fits(group: list[re.Pattern], at: int) -> bool:
        return at + len(group) <= len(printed) and all(p.fullmatch(printed[at + i]) for i, p in enumerate(group))

    def placed(index: int, at: int) -> bool:  # groups[index:] placed in order from printed line `at` on
        if index == len(groups):
            return free_end or at == len(printed)
        group = groups[index]
        starts = range(at, len(printed) - len(group) + 1) if index or free_start else [at]
        return any(fits(group, start) and placed(index + 1, start + len(group)) for start in starts)

    return placed(0, 0)


def test_the_docs_show_the_dry_run_with_its_output():
    assert any("--dry-run" in argv for _, _, argv, _ in shown_outputs())


@pytest.mark.parametrize("where, module, argv, shown", [pytest.param(*case, id=case[0]) for case in shown_outputs()])
def test_a_shown_output_is_what_the_command_prints_now(capfd, where, module, argv, shown):
    result = call(capfd, argv, tool=module)
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert matches(shown, printed), (
        f"{where}: the page shows\n" + "\n".join(shown) + "\n\nthe command prints\n" + (result.stdout)
    )


def test_the_output_comparison_can_fail():
    printed = ["# resolved (/x/recipes/debug.yaml)", "model:", "  dtype: float32", "# plan", "#   lr 3e-4"]
    assert matches(["# resolved (…/recipes/debug.yaml)", "model:", "…", "# plan", "#   lr 3e-4"], printed)
    assert not matches(["# resolved (…/recipes/debug.yaml)", "…", "#   lr 1e-3"], printed)
    assert not matches(["model:", "…"], printed)  # the first shown line is the first printed
    assert not matches(["…", "# plan"], printed)  # the last shown line is the last printed
    assert matches(["…", "  dtype: float32", "…", "#   lr 3e-4"], printed)
    assert matches(["# resolved (…)", "…", "#…", "…"], printed)  # a later "#" line, not the first
