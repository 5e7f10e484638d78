"""A run in a child forked from the test process (tests/test_resume.py, tests/test_faults.py): a process of its
own, with its own file size limit, SIGKILLed or sent SIGTERM as any process is, that starts with torch and
transformers already imported (a fresh interpreter pays 10-15 s for them).

`script(args)` runs finetune/train.py as `python finetune/train.py ARGS` would (sys.argv, `__main__`, its exit);
`resume_main(kill_at, args)` is tests/workers/resume_worker.py's command (a kill or stop armed at KILL_AT)."""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
import traceback

from tests.launch import ENV, ROOT, STOPPED_BY, logs_as_in_a_process

SCRIPT = "finetune/train.py"
RUN_ENV = {key: ENV[key] for key in ("OMP_NUM_THREADS", "WANDB_MODE")}  # what tests.launch.ENV sets for a run


def script(args: list[str], tool: str = SCRIPT) -> None:
    """The entry script as its own interpreter runs it: argv[0] the script's path as typed, run as __main__."""
    sys.argv = [tool, *args]
    runpy.run_path(tool, run_name="__main__")  # from the repository root; it sets argv[0] to the path it is given


def resume_main(kill_at: str, args: list[str]) -> int:
    """tests/workers/resume_worker.py KILL_AT ARGS: finetune/train.py's main with the kill (or stop) armed."""
    import finetune.tools.train
    from tests.workers import resume_worker

    callbacks = resume_worker.arm(kill_at)
    train = finetune.tools.train.train
    finetune.tools.train.train = lambda cfg, argv=None, plan=None: train(cfg, callbacks=callbacks, argv=argv, plan=plan)
    return finetune.tools.train.main(args)


def exit_code(kill_at: str) -> int:
    """What a run armed with `kill_at` that is not killed exits with: 143 after the stop (every rank), else 0."""
    return STOPPED_BY[signal.SIGTERM] if kill_at.startswith("term:") else 0


def resume_rank(kill_at: str, args: list[str]) -> None:
    """resume_main on a rank of tests.launch.forked_ranks: it must exit as exit_code(kill_at) says."""
    assert resume_main(kill_at, args) == exit_code(kill_at)


def _child(target, args: tuple, environ: dict, pipe: int | None, merge: bool) -> None:
    """In the child: `target(*args)` from the repository root; ends the process with its code (or SystemExit's)."""
    code = 70
    try:
        os.chdir(ROOT)
        os.environ.update({**RUN_ENV, **environ})
        if pipe is not None:  # stdout (and stderr with `merge`) to the parent's pipe, a line at a time
            for fd in (1, 2) if merge else (1,):
                os.dup2(pipe, fd)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False) if merge else sys.stderr
        logs_as_in_a_process()
        result = target(*args)
        code = result if isinstance(result, int) else 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int:
    """The child's exit code as subprocess gives it (-9 when SIGKILLed); killed and an error after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked run was still running after {timeout} s")
        time.sleep(0.05)


def forked(capfd, target, *args, timeout: float = 600, before=None, **environ: str) -> subprocess.CompletedProcess:
    """`target(*args)` in a forked child (after `before()` there, e.g. a resource limit); its exit code, stdout and
    stderr (through pytest's `capfd`), as `subprocess.run` reports a process."""
    capfd.readouterr()  # what the test printed before is not this run's
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        if before is not None:
            before()
        _child(target, args, environ, None, False)
    code = _wait(pid, timeout)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([getattr(target, "__name__", str(target)), *args], code, out, err)


def forked_signalled(
    args: list[str], sig: int, after_line: str, merge: bool = False, delay: float = 0.0, **environ: str
) -> tuple[int, str, float | None]:
    """finetune/train.py ARGS in a forked child, sent `sig` `delay` s after a stdout line contains after_line (as
    tests.launch.signalled does to a fresh interpreter); (exit code, stdout, and stderr with `merge`, the moment
    `sig` was sent by time.monotonic())."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _child(script, (args,), environ, write, merge)
    os.close(write)
    lines, sent = [], None
    with open(read, encoding="utf-8", errors="replace") as stdout:
        for line in stdout:
            lines.append(line)
            if sent is None and after_line in line:
                time.sleep(delay)
                sent = time.monotonic()
                os.kill(pid, sig)
        return _wait(pid, 600), "".join(lines), sent
