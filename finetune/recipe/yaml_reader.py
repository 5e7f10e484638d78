"""YAML as a recipe may be written: safe (no Python objects), numbers as YAML 1.2 writes them, no key twice in one
mapping, aliases bounded, UTF-8.

PyYAML reads YAML 1.1, where a float needs a dot (`1e-5` and `1e6` are text) and a bare date is a datetime. A typed
key converts the text later, but an open map (model.config_overrides) would hand it on to the model's config as text;
so a recipe is read as OmegaConf's own loader reads YAML: a float may be written without a dot, and a date stays text.

`yaml.safe_load` keeps the last of two equal keys without a word (a section written twice loses the first), and an
alias may name a node that names others, so a kilobyte of anchors expands to billions of nodes once OmegaConf copies
them. Here both are errors, found on the composed node graph before anything is constructed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from finetune.recipe.fields import RecipeError, first_line

MAX_NODES = 20_000  # expanded nodes a recipe may hold: a real one has hundreds; aliases past this are a bomb
MERGE_TAG = "tag:yaml.org,2002:merge"
FLOAT_TAG = "tag:yaml.org,2002:float"
# YAML 1.2's floats beside 1.1's (the pattern OmegaConf's loader adds): 1e-5, 1e6, 2E+3 (the exponent without a dot)
FLOAT_1_2 = re.compile(
    r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (merge keys `<<:` may still be overridden); its
    scalars resolve as below (YAML 1.2's floats, no timestamps)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                    continue
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep)


_RecipeLoader.add_implicit_resolver(FLOAT_TAG, FLOAT_1_2, list("-+0123456789."))
_RecipeLoader.yaml_implicit_resolvers = {  # no timestamps: a date is text, as OmegaConf reads it (it holds no dates)
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _RecipeLoader.yaml_implicit_resolvers.items()
}


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: yaml.Node, where: str) -> None:
    """The node count once every alias is expanded (shared nodes counted per use, each computed once), iteratively:
    deep documents must not exhaust Python's stack either. An alias inside its own anchor is an error too."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_nodes.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in _children(node)), MAX_NODES + 1)
            if sizes[id(node)] > MAX_NODES:
                raise RecipeError(
                    f"{where}: its anchors and aliases expand to more than {MAX_NODES:,} values; write "
                    "the values out, or use fewer aliases"
                )
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            line = node.start_mark.line + 1
            raise RecipeError(
                f"{where}: an alias at line {line} refers to a value that contains it (a loop); remove the alias"
            )
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def parse_yaml(text: str, where: str) -> Any:
    """The value `text` holds, as safe_load gives it but for YAML 1.2's floats and dates kept as text; RecipeError
    (naming `where`) for invalid YAML, a key twice in one mapping, or aliases that expand too far."""
    try:
        loader = _RecipeLoader(text)  # its reader refuses characters YAML does not allow (control bytes, surrogates)
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: not valid YAML ({first_line(e)}); fix the file") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where)
        return loader.construct_document(node)
    except _DuplicateKey as e:
        raise RecipeError(
            f"{where}: '{e.key}' is written twice in one mapping (lines {e.first} and {e.again}); YAML "
            "would silently keep only the second, so merge them into one"
        ) from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: not valid YAML ({first_line(e)}); fix the file") from None
    except RecursionError:
        raise RecipeError(f"{where}: nested too deeply to read; flatten it") from None
    finally:
        loader.dispose()


def read_yaml_file(file: Path) -> Any:
    """A YAML file's value: one RecipeError for a file that cannot be read, is not UTF-8 or is not valid YAML."""
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise RecipeError(f"{file}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (some editors write one) is not part of the text
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise RecipeError(
            f"{file}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); save it as UTF-8"
        ) from None
    return parse_yaml(text, str(file))
