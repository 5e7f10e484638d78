"""The console of a debug-recipe run with evaluation and samples: one whole line per optimizer step and per evaluation,
samples after their evaluation's line, in a log file (no progress bar: no carriage return, no escape sequence) and in a
terminal (one bar, redrawn under whole lines: never a second bar's cursor moves, never a line glued behind a bar)."""

import fcntl
import logging
import os
import pty
import re
import signal
import struct
import sys
import termios
import threading
import time
import traceback

from tests.launch import ROOT, call

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


def test_console_in_a_log_file_is_whole_lines(tmp_path, capfd):
    result = call(capfd, [*ARGS, f"train.output_dir={tmp_path / 'out'}"])
    assert result.returncode == 0, result.stderr[-4000:]
    for stream in (result.stdout, result.stderr):
        assert "\r" not in stream and "\x1b" not in stream, stream  # no bar: nothing redrawn, no cursor moved
    check_lines(result.stdout.splitlines())


def on_terminal(fd: int) -> None:
    """In a forked child: stdin from /dev/null, stdout and stderr on the terminal `fd`, as a process started there
    has them (the streams and the library log handlers this process had point at pytest's capture)."""
    old = {id(sys.stdout), id(sys.stderr)}
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # a terminal's: line-buffered
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for handler in [h for logger in loggers for h in getattr(logger, "handlers", ())]:
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in old:
            handler.setStream(sys.stderr)


def run_in_terminal(argv: list[str], columns: int = 160) -> tuple[int, str]:
    """(exit code, everything written to the terminal) of the training command with `argv`, stdout and stderr on one
    pseudo-terminal: in a child forked from this process, which has torch and transformers imported already."""
    from finetune.tools.train import main as train_main

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 70
        try:
            on_terminal(child)
            os.chdir(ROOT)
            code = train_main(argv)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
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
    deadline = time.monotonic() + 600
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    reader.join(timeout=30)
    os.close(main)
    return os.waitstatus_to_exitcode(status[1]), b"".join(chunks).decode("utf-8", errors="replace")


def test_console_in_a_terminal_has_one_bar_under_whole_lines(tmp_path):
    code, shown = run_in_terminal([*ARGS, f"train.output_dir={tmp_path / 'out'}"])
    assert code == 0, shown[-4000:]
    assert "\x1b[A" not in shown  # a second bar (tqdm's nested bars move the cursor up)
    assert re.search(r"\| \d/4 \[", shown), shown[-2000:]  # the bar was drawn
    # what each line finally shows: the text after the last carriage return (the bar's redraws are overwritten)
    lines = [segment.rsplit("\r", 1)[-1] for segment in shown.replace("\r\n", "\n").split("\n")]
    check_lines(lines)
