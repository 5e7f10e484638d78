"""Faults during a run: streamed runs stopped and resumed, saves that fail, machine faults at the boundary, changed
recipes and data at resume, W&B without a network, signals however the run was launched (issue 21).

Every run here is the command a user runs (a subprocess on the debug recipe), stopped at a chosen moment."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_resume import assert_same_run

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
BASE = ["recipe=recipes/debug.yaml", "data.limit=16", "data.max_length=64", "log.wandb_mode=disabled"]
STREAM = [*BASE, "data.streaming=true", "train.max_steps=6"]  # 2 optimizer steps per pass: 3 passes


def run(args: list[str], env: dict | None = None, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "finetune/train.py", *args], cwd=ROOT, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=600, preexec_fn=preexec)


def signalled(cmd: list[str], sig: int, after_line: str) -> tuple[int, str]:
    """Start cmd, send `sig` once a stdout line contains after_line; (exit code, stdout)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if after_line in line:
            proc.send_signal(sig)
            break
    lines += proc.stdout.readlines()
    return proc.wait(timeout=600), "".join(lines)


def checkpoint_names(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


# ---- 1. streamed runs checkpoint and resume exactly ----


@pytest.mark.e2e
@pytest.mark.subprocess
def test_a_streamed_run_stopped_twice_resumes_bitwise(tmp_path):
    reference = tmp_path / "reference"
    done = run([*STREAM, "train.save_steps=2", f"train.output_dir={reference}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint_names(reference) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    state = json.loads((reference / "checkpoint-4" / "finetune_state.json").read_text())
    assert state["data_position"]["dataset_items"] == "stream"

    out = tmp_path / "stopped"
    cmd = [sys.executable, "finetune/train.py", *STREAM, "train.save_steps=2", f"train.output_dir={out}",
           "train.resume_from=auto"]
    code, stdout = signalled(cmd, signal.SIGTERM, "step 1/6")  # mid-pass, before the first save_steps checkpoint
    assert code == 0 and "stopped by SIGTERM" in stdout, stdout[-3000:]
    first = checkpoint_names(out)
    assert first and first[-1] in ("checkpoint-2", "checkpoint-3"), first
    code, stdout = signalled(cmd, signal.SIGTERM, "step 4/6")  # the second and third passes
    assert code == 0 and f"resuming from {out / first[-1]}" in stdout, stdout[-3000:]
    assert "stopped by SIGTERM" in stdout, stdout[-3000:]
    finished = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_same_run(out, reference)
    for name in checkpoint_names(out):  # every checkpoint of the chain equals the reference's at its step
        if (reference / name).is_dir():
            assert_same_run(out / name, reference / name)
    assert not (out / ".staging").exists()


def torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "finetune/train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.distributed
def test_a_streamed_run_on_two_ranks_resumes_bitwise(tmp_path):
    args = [*BASE, "data.streaming=true", "train.max_steps=4", "train.save_steps=1"]
    reference = tmp_path / "reference"
    done = torchrun([*args, f"train.output_dir={reference}"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-1", out / "checkpoint-1")  # 2 ranks × 4 rows of 16: mid-pass
    resumed = torchrun([*args, f"train.output_dir={out}", "train.resume_from=auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-1'}" in resumed.stdout
    assert_same_run(out, reference)
