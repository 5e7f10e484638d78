"""finetune-launch (finetune/tools/launcher.py) passes a stop on to everything its command started and exits with the
code the run's stop wrote, not the launcher's 1: shown on a stand-in launcher of a few lines that behaves as torchrun
and a one-process `accelerate launch` do (it exits 1 at once on SIGTERM, its rank saves after it has gone). The real
launchers under it, as a container's PID 1, are in tests/test_faults.py's launcher matrix (slow tier)."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from finetune.tools.launcher import exit_status, main
from tests.launch import ON_PATH, ROOT

# a rank: on SIGTERM it takes 0.5 s to "save", writes its stop code where finetune-launch said, and exits with it
RANK = """
import os, signal, sys, time
def stop(signum, frame):
    time.sleep(0.5)
    code = 128 + signum
    if os.environ.get("FINETUNE_STOP_CODE_FILE"):
        open(os.environ["FINETUNE_STOP_CODE_FILE"], "w").write(f"{code}\\n")
    print(f"rank saved after {signal.Signals(signum).name}", flush=True)
    os._exit(code)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print("rank ready", flush=True)
time.sleep(60)
"""
# the launcher: starts the rank in its own process group and, on a signal, exits 1 at once, leaving the rank behind
LAUNCHER = f"""
import os, signal, subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", {RANK!r}])
signal.signal(signal.SIGTERM, lambda s, f: os._exit(1))
signal.signal(signal.SIGINT, lambda s, f: os._exit(1))
sys.exit(rank.wait())
"""
LAUNCH = [sys.executable, "-m", "finetune.tools.launcher"]


def launched(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [*LAUNCH, *command],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ON_PATH},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.subprocess  # signals to a supervising process and the processes under it are the behaviour
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_exits_with_the_runs_code_after_the_rank_the_launcher_left_has_saved(sig):
    proc = launched([sys.executable, "-c", LAUNCHER])
    assert proc.stdout.readline() == "rank ready\n"
    sent = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(timeout=30)
    assert time.monotonic() - sent >= 0.5  # it waited for the rank's save, not only for the launcher's exit 1
    assert proc.stdout.read() == f"rank saved after {sig.name}\n"
    assert code == 128 + sig  # 143 / 130: the run's stop, not the launcher's 1


@pytest.mark.subprocess
def test_without_a_stop_the_commands_own_code_and_a_missing_command_is_one_line():
    assert launched([sys.executable, "-c", "import sys; sys.exit(3)"]).wait(timeout=30) == 3
    killed = launched([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.wait(timeout=30) == 128 + signal.SIGKILL  # as a shell reports it
    missing = launched(["no-such-launcher", "finetune/train.py"])
    assert missing.wait(timeout=30) == 127
    assert (
        missing.stderr.read() == "error: finetune-launch cannot start 'no-such-launcher': No such file or directory\n"
    )


def test_usage_and_exit_status(capsys):
    assert main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: finetune-launch COMMAND")
    assert main([]) == 2 and capsys.readouterr().err.startswith("usage: finetune-launch COMMAND")
    assert exit_status(0) == 0 and exit_status(1) == 1 and exit_status(-signal.SIGTERM) == 143


@pytest.mark.parametrize(
    "environ, launcher",
    [
        ({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, "finetune-launch torchrun [the same launch options] "),
        ({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "no"}, "finetune-launch accelerate launch [the same "),
        ({}, f"finetune-launch {shlex.quote(sys.executable)} "),
    ],
)
def test_the_resume_line_of_a_run_under_finetune_launch_names_it(environ, launcher, monkeypatch, tmp_path):
    """A stopped run prints the command that resumes it; under finetune-launch (which set the stop-code file for its
    ranks) that command starts with finetune-launch too, so a restart keeps the stop's exit code."""
    from finetune.env import STOP_CODE_FILE
    from finetune.training.lifecycle import resume_command

    for key in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    argv = ["recipe=recipes/debug.yaml", "train.resume_from=step-3"]
    monkeypatch.setenv(STOP_CODE_FILE, str(tmp_path / "code"))
    assert resume_command(argv).startswith(launcher)
    assert resume_command(argv).endswith("recipe=recipes/debug.yaml train.resume_from=auto")
    monkeypatch.delenv(STOP_CODE_FILE)
    assert not resume_command(argv).startswith("finetune-launch")
