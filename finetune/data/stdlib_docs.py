"""The built-in `stdlib_docs` SFT set: questions about the standard library answered by its own docstrings.

For each stdlib module (`sys.stdlib_module_names`, sorted; GUI, platform and side-effect modules skipped) the public
functions and classes whose `__module__` is that module and that carry their own docstring become one conversation:
"What does `json.dumps` do?" (or "What is `json.JSONEncoder`?") → `inspect.getdoc(obj)`. Built in-process once per
Python version and cached as jsonl under `$FINETUNE_CACHE` (default ~/.cache/finetune).
The set depends a little on what the building process imported before (torch replaces `inspect.getfile`, which then
no longer counts as the stdlib's); the cache file fixes it once per Python version.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

from finetune.env import cache_dir

BUILD_VERSION = 1  # bump when the selection rules change: the cache file name carries it
MIN_DOC_CHARS = 16  # drops AST node stubs such as "Add"
PER_MODULE_CAP = 120  # keeps posix, ast and builtins from dominating (sorted names, first N)
SKIP = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "ensurepip",
    "venv",
    "lib2to3",
    "test",
    "pydoc_data",
    "__main__",
    "msilib",
    "winreg",
    "winsound",
    "readline",
    "rlcompleter",  # importing them changes the terminal / interpreter state
    "distutils",  # replaced by setuptools' copy when setuptools is installed: not the stdlib's docs
}


def cache_path() -> Path:
    version = ".".join(map(str, sys.version_info[:3]))
    return cache_dir() / "data" / f"stdlib_docs-v{BUILD_VERSION}-py{version}.jsonl"


def _module_rows(name: str, module, seen: set[str]) -> list[dict]:
    rows = []
    for attr, obj in sorted(vars(module).items()):
        if len(rows) >= PER_MODULE_CAP:
            break
        if attr.startswith("_"):
            continue
        is_class = inspect.isclass(obj)
        if not (is_class or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", None) != name or getattr(obj, "__name__", None) != attr:
            continue  # imported from elsewhere, or an alias
        if getattr(obj, "__doc__", None) is None:
            continue  # getdoc would return a base class's docstring
        doc = inspect.getdoc(obj)
        if not doc or len(doc) < MIN_DOC_CHARS or doc in seen:
            continue
        seen.add(doc)
        question = f"What is `{name}.{attr}`?" if is_class else f"What does `{name}.{attr}` do?"
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": doc}]})
    return rows


def build_rows() -> list[dict]:
    """The rows, in a deterministic order; module imports are silenced and failures skipped."""
    rows: list[dict] = []
    seen: set[str] = set()  # identical docstrings (re-exported helpers) kept once
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if name.startswith("_") or name in SKIP:
                continue
            try:
                module = importlib.import_module(name)
            except BaseException:  # ImportError, or a module that exits or fails on this platform
                continue
            rows += _module_rows(name, module, seen)
    return rows


def ensure_cached() -> Path:
    """The cached jsonl, built once per Python version and written atomically (complete or absent)."""
    path = cache_path()
    if path.is_file():
        return path
    rows = build_rows()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".stdlib_docs-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.chmod(scratch, 0o644)
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return path
