"""The console of a debug-recipe run with evaluation and samples: one whole line per optimizer step and per evaluation,
samples after their evaluation's line, in a log file (no progress bar: no carriage return, no escape sequence) and in a
terminal (one bar, redrawn under whole lines: never a second bar's cursor moves, never a line glued behind a bar)."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "recipe=recipes/debug.yaml",
    "data.limit=32",
    "train.max_steps=4",
    "eval.fraction=0.25",
    "eval.every_steps=2",
    "eval.samples=1",
    "eval.max_new_tokens=8",
    "log.wandb_mode=disabled",
]
STEP = re.compile(
    r"^step (\d+)/4  loss \d+\.\d{4}  lr \S+  grad_norm \S+  targets \d+  tok/s \d+  real \d+%  mem \d+ MB$"
)
EVAL = re.compile(r"^eval at step (\d+)/4  loss \d+\.\d{4}  ppl [\d.]+  acc \d\.\d{4}  targets [\d,]+  tok/s \d+$")


def check_lines(lines: list[str]) -> None:
    """Steps 1-4 and evaluations at 0, 2 and 4, each alone on its line; each evaluation's sample right after it."""
    steps = [int(m[1]) for line in lines if (m := STEP.match(line))]
    evals = [(k, int(m[1])) for k, line in enumerate(lines) if (m := EVAL.match(line))]
    assert steps == [1, 2, 3, 4], lines
    assert [step for _, step in evals] == [0, 2, 4], lines
    for k, _ in evals:
        assert lines[k + 1].startswith("  held out 1: ") and lines[k + 2].startswith("    model:"), lines[k : k + 4]
    glued = [line for line in lines if re.search(r"step \d+/4", line) and not (STEP.match(line) or EVAL.match(line))]
    assert glued == []


@pytest.mark.subprocess
def test_console_in_a_log_file_is_whole_lines(tmp_path):
    result = subprocess.run(
        [sys.executable, "finetune/train.py", *ARGS, f"train.output_dir={tmp_path / 'out'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for stream in (result.stdout, result.stderr):
        assert "\r" not in stream and "\x1b" not in stream, stream  # no bar: nothing redrawn, no cursor moved
    check_lines(result.stdout.splitlines())


def run_in_terminal(argv: list[str], columns: int = 160) -> tuple[int, str]:
    """(exit code, everything written to the terminal) of `argv` with stdout and stderr on one pseudo-terminal."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    process = subprocess.Popen(
        argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=child, stderr=child, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    os.close(child)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # the child side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = process.wait(timeout=600)
    reader.join(timeout=30)
    os.close(main)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.subprocess
def test_console_in_a_terminal_has_one_bar_under_whole_lines(tmp_path):
    code, shown = run_in_terminal([sys.executable, "finetune/train.py", *ARGS, f"train.output_dir={tmp_path / 'out'}"])
    assert code == 0, shown[-4000:]
    assert "\x1b[A" not in shown  # a second bar (tqdm's nested bars move the cursor up)
    assert re.search(r"\| \d/4 \[", shown), shown[-2000:]  # the bar was drawn
    # what each line finally shows: the text after the last carriage return (the bar's redraws are overwritten)
    lines = [segment.rsplit("\r", 1)[-1] for segment in shown.replace("\r\n", "\n").split("\n")]
    check_lines(lines)
