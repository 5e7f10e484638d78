"""The entry points as users run them: a recipe mistake is one line, exit code 2, before torch is imported (the
training script, `python -m finetune.plan`, `python -m finetune.verify`), and built-in recipes are found by name."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = {
    "train": [str(ROOT / "finetune" / "train.py")],
    "plan": ["-m", "finetune.plan"],
    "verify": ["-m", "finetune.verify"],
}


def imported_modules(stderr: str) -> set[str]:
    """Every module `python -X importtime` reported importing."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.subprocess
@pytest.mark.parametrize("entry", ENTRIES.values(), ids=ENTRIES.keys())
def test_a_recipe_typo_is_reported_before_torch_is_imported(entry, tmp_path):
    # recipe=debug from another working directory: the built-in recipe is found, then the typo stops the run
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *entry, "recipe=debug", "optim.lrr=1e-4"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert lines == ["error: command line: unknown key 'optim.lrr'; did you mean 'optim.lr'?"]
    imported = imported_modules(result.stderr)
    assert "finetune.recipe" in imported
    assert not {"torch", "transformers"} & imported
