"""Image files of image+text rows: open one (a path, bytes, a PIL image), what a dataset stores of it (a path or
encoded bytes, never pixels), and where a row's relative image paths start.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

from finetune.data.sources import BadRow
from finetune.recipe import first_line


def open_image(ref: Any, base: Path | None = None):
    """A PIL RGB image from a PIL image, a path (relative to `base`), bytes, or a datasets {"bytes", "path"} dict."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, (bytes, bytearray)):
        source, name = io.BytesIO(ref), "encoded image"
    elif isinstance(ref, (str, os.PathLike)) and str(ref):
        path = Path(ref).expanduser()
        source = name = str(path if path.is_absolute() or base is None else base / path)
        if not Path(source).is_file():
            raise BadRow(f"image {name} not found")
    else:
        raise BadRow(f"image is {type(ref).__name__}, not a path, bytes or a PIL image")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")  # decodes now: a truncated or corrupt file fails here, naming its row
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        why = first_line(e)
        raise BadRow(f"image {name} cannot be read ({why})") from None


def stored_image(ref: Any, image, base: Path | None) -> dict:
    """What the dataset keeps: the file's absolute path, or encoded bytes (PNG for in-memory images)."""
    if isinstance(ref, dict) and ref.get("bytes"):
        return {"bytes": ref["bytes"], "path": None}
    if isinstance(ref, (bytes, bytearray)):
        return {"bytes": bytes(ref), "path": None}
    if isinstance(ref, (str, dict)):
        path = Path(ref if isinstance(ref, str) else ref["path"]).expanduser()
        return {"bytes": None, "path": str(path if path.is_absolute() or base is None else (base / path).resolve())}
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def image_base_dir(where: str) -> Path | None:
    """Relative image paths are relative to the file the row came from ("data/train.jsonl line 7")."""
    match = re.match(r"(.*) (?:line|row|item) \d+$", where)
    return Path(match.group(1)).parent if match and Path(match.group(1)).is_file() else None


def stored_ref(stored: dict):
    """What `open_image` takes back from a `stored_image` entry."""
    return stored.get("bytes") or stored.get("path")
