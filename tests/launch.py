"""Starting the commands and the test workers as a user would: the entry scripts, torchrun, `accelerate launch` on
two CPU ranks, a run that is sent a signal; and reading what a run left (its one error line, its per-step logs, its
weights bit for bit)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# the repository first on PYTHONPATH, the caller's entries kept (a GPU machine's carried packages live there)
ON_PATH = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# `accelerate launch` on two ranks (real DDP; on gloo with ACCELERATE_USE_CPU=true): the script and its arguments follow
TWO_RANKS = [
    ACCELERATE,
    "launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
    "--main_process_port",
    "0",
]
# `accelerate launch` on one process (as PID 1 of a container it drops SIGTERM): the script and its arguments follow
ONE_RANK = [ACCELERATE, "launch", "--num_processes", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
# a run stopped by a signal saves the last step and exits 128 + the signal's number, as a shell reports it
STOPPED_BY = {signal.SIGTERM: 143, signal.SIGINT: 130}
LOGGED = ("step", "loss", "grad_norm", "learning_rate", "window_label_tokens", "epoch", "nonfinite_skipped")


def run(args: list[str], tool: str = "finetune/train.py", timeout: int = 300, **kwargs):
    """A command (`tool`: a script path, or a module for -m) with `args`, from the repository root."""
    cmd = [sys.executable, tool] if tool.endswith(".py") else [sys.executable, "-m", tool]
    return subprocess.run(
        [*cmd, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        **kwargs,
    )


def logs_as_in_a_process() -> Callable[[], None]:
    """Log records reach the current sys.stderr as in a fresh interpreter: the root logger without pytest's handlers
    (which keep records off stderr; without handlers, logging's last resort writes them there) and the libraries' own
    stream handlers (transformers', datasets', bound at import to the stream of that moment) writing to sys.stderr. A
    run in this process sees its library warnings as a process would; the function that undoes it is returned."""
    root = logging.getLogger()
    saved_root = root.handlers[:]
    root.handlers[:] = []
    moved = [
        (handler, handler.stream)
        for logger in logging.Logger.manager.loggerDict.values()
        for handler in getattr(logger, "handlers", [])
        if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr
    ]
    for handler, _ in moved:  # not setStream: it flushes the old stream, maybe an earlier test's, closed since
        handler.stream = sys.stderr

    def undo() -> None:
        for handler, stream in reversed(moved):
            handler.stream = stream
        root.handlers[:] = saved_root

    return undo


@contextlib.contextmanager
def process_logs():
    """logs_as_in_a_process for the length of a `with` block."""
    undo = logs_as_in_a_process()
    try:
        yield
    finally:
        undo()


# each command `run` starts, by the module whose main(argv) it runs
MAINS = {
    "finetune/train.py": "finetune.tools.train",
    "finetune.train": "finetune.tools.train",
    "finetune.plan": "finetune.tools.plan",
    "finetune.verify": "finetune.tools.verify",
}


# what a run sets for W&B in its process (WANDB_DIR: the run's folder); a process's exit forgets them
WANDB_VARIABLES = ("WANDB_DIR", "WANDB_MODE", "WANDB_PROJECT", "WANDB_SILENT")


@contextlib.contextmanager
def environ_kept(*keys: str):
    """The environment variables `keys` as they were before the block, whatever the block set."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def call(capfd, args: list[str], tool: str = "finetune/train.py", **environ: str) -> subprocess.CompletedProcess:
    """`run`'s command called in this process, as `run` would start it: main(args) from the repository root with
    `environ` set, its exit code (a SystemExit's code too) and what reached this process's stdout and stderr (the
    file descriptors, through pytest's `capfd`), log records included as a process of its own prints them. What a
    process's exit does after it is done here too: W&B's service writes the run out and forgets its settings, and the
    environment the command changed is restored."""
    import importlib

    main = importlib.import_module(MAINS[tool]).main
    capfd.readouterr()  # what earlier steps of the test printed is not this command's
    cwd = os.getcwd()
    with environ_kept(*WANDB_VARIABLES, *environ):
        os.chdir(ROOT)
        os.environ.pop("WANDB_DIR", None)  # an earlier run's folder
        os.environ.update(environ)
        try:
            with process_logs():  # library warnings reach stderr as they do in a process of its own
                code = main(list(args))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            if "wandb" in sys.modules:
                sys.modules["wandb"].teardown()
            os.chdir(cwd)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([tool, *args], code, out, err)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CORES_LOCK = os.path.join(tempfile.gettempdir(), "finetune-tests-cores.lock")
_cores_lock: list = []  # this process's open lock file, opened on first use
_sharing = [False]  # whether this process holds the shared lock (a test is running: share_of_the_cores)


def cores_lock():
    if not _cores_lock:
        _cores_lock.append(open(CORES_LOCK, "a"))  # noqa: SIM115 - held for the worker's life
    return _cores_lock[0]


@contextlib.contextmanager
def share_of_the_cores():
    """What every test holds while it runs (tests/conftest.py): a shared lock, so that a test which needs the cores to
    itself (turn_at_the_cores) waits for the other pytest-xdist workers' running tests and they wait for it."""
    import fcntl

    fcntl.flock(cores_lock(), fcntl.LOCK_SH)
    _sharing[0] = True
    try:
        yield
    finally:
        _sharing[0] = False
        fcntl.flock(cores_lock(), fcntl.LOCK_UN)


@contextlib.contextmanager
def turn_at_the_cores():
    """The machine's cores to this test alone while its ranks run: gloo ranks wait for each other by polling, and on
    two cores a rank that another worker's test keeps off a core stalls its peer (a 9 s two-rank test took 25 s). The
    lock shared by every running test is exchanged for the exclusive one and back (flock converts by releasing
    first, so two workers converting at once cannot deadlock); the wait is not charged to the test's time budget
    (tests/budget.py)."""
    import fcntl

    from tests.budget import not_charged

    asked = time.monotonic()
    fcntl.flock(cores_lock(), fcntl.LOCK_EX)
    not_charged(time.monotonic() - asked)
    try:
        yield
    finally:
        fcntl.flock(cores_lock(), fcntl.LOCK_SH if _sharing[0] else fcntl.LOCK_UN)


def forked_ranks(target, *args, nproc: int = 2, timeout: float = 300, **environ: str) -> None:
    """`target(*args)` on `nproc` gloo ranks forked from this process, as accelerate's debug_launcher starts them:
    each rank inherits the imported torch and transformers (a fresh interpreter pays 10-15 s for them) and sees the
    environment torchrun gives a rank (plus `environ`). A rank ends without tearing objects down (as
    finetune.env.exit_process ends a launched rank); one that raises fails the test with its traceback."""
    import multiprocessing
    import traceback

    fork = multiprocessing.get_context("fork")
    failures = fork.SimpleQueue()
    launched = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TORCHELASTIC_RUN_ID": "forked",
        "OMP_NUM_THREADS": "1",
        **environ,
    }

    def rank_main(rank: int) -> None:
        os.environ.update({**launched, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        torch.set_num_threads(1)
        code = 0
        try:
            target(*args)
        except BaseException:
            failures.put(f"rank {rank}:\n{traceback.format_exc()}")
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    ranks = [fork.Process(target=rank_main, args=(rank,), daemon=True) for rank in range(nproc)]
    with turn_at_the_cores():
        gc.freeze()  # a rank's collections (accelerate runs several) skip the test process's whole inherited heap
        try:
            for process in ranks:
                process.start()
        finally:
            gc.unfreeze()
        for process in ranks:
            process.join(timeout)
        hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
        for process in ranks:
            process.kill() if process.is_alive() else None
    errors = [failures.get() for _ in range(sum(process.exitcode == 1 for process in ranks))]
    assert not hung and not errors, f"ranks still running after {timeout} s: {hung}\n" + "\n".join(errors)
    assert all(process.exitcode == 0 for process in ranks), [process.exitcode for process in ranks]


def assert_one_error(result, message: str, out: Path | None = None, code: int = 2) -> None:
    """Exit `code`, one `error:` line matching `message`, no traceback, nothing written under `out`."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == code, result.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.search(message, errors[0]), errors[0]
    if out is not None:
        assert not out.exists() or not any(out.rglob("*")), list(out.rglob("*"))


def step_logs(folder: Path) -> list[dict]:
    """The per-step entries of a saved trainer_state.json, with the fields a resumed run must repeat."""
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [{k: e.get(k) for k in LOGGED} for e in history if "loss" in e and "grad_norm" in e]


def assert_same_run(folder: Path, reference: Path) -> None:
    """The same per-step logs and bitwise the same weights (the model or the LoRA adapter)."""
    assert step_logs(folder) == step_logs(reference)
    name = "model.safetensors" if (reference / "model.safetensors").is_file() else "adapter_model.safetensors"
    got, want = load_file(folder / name), load_file(reference / name)
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"weights differ bitwise: {different[:3]}"
