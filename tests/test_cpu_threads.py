"""CPU runs compute on every physical core unless the user chose OMP_NUM_THREADS, also under `accelerate launch`
(which sets OMP_NUM_THREADS=1 itself when not told otherwise); the start line says how many threads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.env import cpu_threads, physical_cores, threads_chosen

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = {"ACCELERATE_MIXED_PRECISION": "no"}  # what every `accelerate launch` sets


def launched(environ: dict, argv: list[str]):
    return lambda: (environ, argv)


def test_threads_the_user_chose_count_and_a_launchers_default_does_not():
    assert threads_chosen({}) is None
    assert threads_chosen({"OMP_NUM_THREADS": "3"}) == 3  # plain python: the user's
    assert threads_chosen({"OMP_NUM_THREADS": "0"}) is None
    assert threads_chosen({"OMP_NUM_THREADS": "many"}) is None
    under = {**ACCELERATE, "OMP_NUM_THREADS": "1"}
    assert threads_chosen(under, launched({}, ["accelerate", "launch", "train.py"])) is None  # accelerate's default
    assert threads_chosen(under, launched({"OMP_NUM_THREADS": "1"}, ["accelerate", "launch"])) == 1  # the user's
    passed = ["accelerate", "launch", "--num_cpu_threads_per_process", "1", "train.py"]
    assert threads_chosen(under, launched({}, passed)) == 1
    assert threads_chosen(under, launched({}, ["accelerate", "launch", "--num_cpu_threads_per_process=1"])) == 1
    assert threads_chosen(under, lambda: None) == 1  # cannot tell (no /proc): the value stands
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1"}
    assert threads_chosen(torchrun, launched({}, ["torchrun", "--nproc-per-node", "2"])) is None


def test_the_cores_are_shared_by_the_ranks_on_the_machine():
    cores = physical_cores()
    assert 1 <= cores <= os.cpu_count()
    assert cpu_threads({}, lambda: None)[0] == cores
    ranks = {**ACCELERATE, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
    threads, why = cpu_threads(ranks, launched({}, ["accelerate", "launch"]))
    assert threads == max(1, cores // 2) and "shared by 2 ranks" in why


@pytest.mark.subprocess
@pytest.mark.parametrize("user_threads", [None, "1"], ids=["accelerate's default", "the user's choice"])
def test_accelerate_launch_uses_every_core_unless_the_user_chose(tmp_path, user_threads):
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if user_threads:
        environ["OMP_NUM_THREADS"] = user_threads
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    args = ["recipe=recipes/debug.yaml", "data.limit=16", "train.max_steps=1", f"train.output_dir={tmp_path / 'out'}"]
    result = subprocess.run(
        [*launch, "finetune/train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=environ
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("cpu: ")]
    cores = physical_cores()
    if user_threads:
        assert lines == ["cpu: 1 thread (OMP_NUM_THREADS=1)"], result.stdout
    else:
        plural = "s" if cores > 1 else ""
        expected = rf"^cpu: {cores} thread{plural} \({cores} physical cores; OMP_NUM_THREADS=N chooses\)$"
        assert len(lines) == 1 and re.match(expected, lines[0]), result.stdout


def test_an_in_process_run_takes_the_thread_choice_as_a_launched_run_does(monkeypatch, capsys):
    """train() in this process sets torch's threads from OMP_NUM_THREADS as a launched run does (tests that compare
    in-process runs with launched ones bit for bit set it alike: tests/test_resume.py)."""
    import torch

    from finetune.tools.train import use_cpu_threads

    before = torch.get_num_threads()
    try:
        for chosen in ("1", "2"):
            monkeypatch.setenv("OMP_NUM_THREADS", chosen)
            use_cpu_threads()
            assert torch.get_num_threads() == int(chosen)
            assert f"(OMP_NUM_THREADS={chosen})" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)
