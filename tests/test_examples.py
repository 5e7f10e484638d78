"""docs/examples/slurm.sh as Slurm runs it, with stand-ins for `finetune-launch` and `scontrol` on PATH (no cluster
here): SIGTERM to the batch shell reaches the run, the shell waits for its save, and a stop code (143, 130) requeues
the job, whoever stopped the run; a finished run (0) and a failed one end the job with their code. What
finetune-launch itself exits with after a real stop: tests/test_launcher.py and tests/test_stop_matrix.py."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch import ROOT

# the run: records its arguments; "stop" waits for SIGTERM and exits 143 after a 0.3 s save; else exits with $RUN_EXITS
LAUNCH = """#!/bin/bash
echo "$@" > "$CALLS/launched"
if [ "$RUN_EXITS" = stop ]; then
    trap 'sleep 0.3; echo saved > "$CALLS/saved"; exit 143' TERM
    sleep 30 &
    wait $!
fi
exit "$RUN_EXITS"
"""
SCONTROL = """#!/bin/bash
echo "$@" >> "$CALLS/scontrol"
"""


def batch_job(tmp_path: Path, run_exits: str) -> subprocess.Popen:
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, text in (("finetune-launch", LAUNCH), ("scontrol", SCONTROL)):
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    environ = {
        **os.environ,
        "PATH": f"{stand_ins}{os.pathsep}{os.environ['PATH']}",
        "CALLS": str(tmp_path),
        "RUN_EXITS": run_exits,
        "SLURM_JOB_ID": "42",
        "SLURM_GPUS_ON_NODE": "8",
    }
    return subprocess.Popen(["bash", str(ROOT / "docs" / "examples" / "slurm.sh")], cwd=tmp_path, env=environ)


def launched(tmp_path: Path) -> str:
    for _ in range(200):
        if (tmp_path / "launched").exists():
            return (tmp_path / "launched").read_text()
        time.sleep(0.05)
    raise AssertionError("the batch job never started its run")


@pytest.mark.subprocess  # a shell's traps and waits are the behaviour
def test_slurms_signal_to_the_batch_shell_waits_for_the_save_and_requeues(tmp_path):
    job = batch_job(tmp_path, "stop")
    assert launched(tmp_path).startswith("torchrun --standalone --nproc_per_node=8 finetune/train.py recipe=")
    time.sleep(0.2)  # the trap is set once the run has started
    job.send_signal(signal.SIGTERM)  # --signal=B:TERM@120
    assert job.wait(timeout=30) == 0
    assert (tmp_path / "saved").exists()  # requeued only after the save
    assert (tmp_path / "scontrol").read_text() == "requeue 42\n"


@pytest.mark.subprocess
@pytest.mark.parametrize("run_exits, requeued", [("143", True), ("130", True), ("0", False), ("2", False)])
def test_the_runs_own_code_decides_requeue_or_end(run_exits, requeued, tmp_path):
    """A stop another sender caused (a preemption's SIGTERM to every process of the job) exits 143 too."""
    job = batch_job(tmp_path, run_exits)
    assert job.wait(timeout=30) == (0 if requeued else int(run_exits))
    assert (tmp_path / "scontrol").exists() == requeued
