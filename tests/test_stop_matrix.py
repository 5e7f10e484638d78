"""A stop is one stop, whatever starts the run: SIGTERM to each launcher, to its process group, and to it as a
container's PID 1 (the first process of a PID namespace) saves the last optimizer step, prints one `stopped by` line,
and ends with the code documented for that launcher (docs/runs.md); the resume from that checkpoint equals the
uninterrupted run bit for bit. Every cell is a real launcher with its fresh interpreters and ranks: the slow tier.
docs/examples/k8s-job.yaml's podFailurePolicy is checked against the codes these cells end with."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.tools.launcher import exit_status
from tests.launch import (
    ENV,
    ON_PATH,
    ONE_RANK,
    ROOT,
    STOPPED_BY,
    TWO_RANKS,
    assert_same_run,
    call,
    forked_ranks,
    turn_at_the_cores,
)

BASE = ["recipe=recipes/debug.yaml", "data.limit=16", "data.max_length=64", "log.wandb_mode=disabled"]
STEPS = 40  # the stop lands a step or two after the signal: far from the end
RUN_ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
BIN = Path(sys.executable).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
STOPPED = STOPPED_BY[signal.SIGTERM]  # 143: "stopped, resume me"
LAUNCHER_REPLACES_IT = 1  # torchrun and a multi-process accelerate launch exit 1 after their ranks stopped and saved

SCRIPT = "finetune/train.py"
# launcher: (the command before the recipe's arguments, ranks)
LAUNCHERS = {
    "python finetune/train.py": ([sys.executable, SCRIPT], 1),
    "finetune-train": ([str(BIN / "finetune-train")], 1),
    "accelerate launch, 1 process": ([*ONE_RANK, SCRIPT], 1),
    "accelerate launch, 2 processes": ([*TWO_RANKS, SCRIPT], 2),
    "torchrun": ([*TORCHRUN, SCRIPT], 2),
    "finetune-launch torchrun": ([str(BIN / "finetune-launch"), *TORCHRUN, SCRIPT], 2),
    "finetune-launch accelerate launch, 1 process": ([str(BIN / "finetune-launch"), *ONE_RANK, SCRIPT], 1),
}
# (launcher, whom SIGTERM is sent to, the launcher's exit code as a shell reports it, the stop the run names)
CELLS = [
    *(
        (name, target, STOPPED, "SIGTERM")
        for name in ("python finetune/train.py", "finetune-train")
        for target in ("the process", "its group", "PID 1")
    ),
    # the one-process launcher dies of the signal at once (143 as a shell reports it); its training process hears of
    # it (a parent-death signal of its own) and saves. As PID 1 it drops the signal: a start-up warning, below.
    ("accelerate launch, 1 process", "the process", STOPPED, "the launcher's exit"),
    ("accelerate launch, 1 process", "its group", STOPPED, "SIGTERM"),
    *(
        (name, target, LAUNCHER_REPLACES_IT, "SIGTERM")
        for name in ("accelerate launch, 2 processes", "torchrun")
        for target in ("the process", "its group", "PID 1")
    ),
    *(("finetune-launch torchrun", target, STOPPED, "SIGTERM") for target in ("the process", "its group", "PID 1")),
    # what a one-process launcher drops as PID 1, finetune-launch before it catches and passes on
    ("finetune-launch accelerate launch, 1 process", "PID 1", STOPPED, "SIGTERM"),
]
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]  # the command becomes PID 1 of a new PID namespace


@pytest.fixture(scope="module")
def pid_namespace():
    """unshare needs root (or user namespaces); CI runs as root."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here ({probe.stderr.strip()[:120]}; needs root)")


def namespace_init(unshare_pid: int) -> int:
    """The host's PID of the namespace's PID 1: the child of `unshare --fork`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == unshare_pid:
                return int(entry.name)
    raise AssertionError(f"no child of unshare {unshare_pid}")


def stopped(command: list[str], target: str, after_line: str) -> tuple[int, str]:
    """`command` started in a session of its own (as PID 1 of a PID namespace for target "PID 1"), sent SIGTERM once
    a line of its output contains `after_line`: (its exit code as a shell reports it, its output to the end)."""
    as_pid1 = target == "PID 1"
    proc = subprocess.Popen(
        [*UNSHARE, *command] if as_pid1 else command,
        cwd=ROOT,
        env={**ENV, "PYTHONPATH": ON_PATH, "ACCELERATE_USE_CPU": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if after_line in line:
            if as_pid1:  # as docker stop or the kubelet send it: to the namespace's first process
                os.kill(namespace_init(proc.pid), signal.SIGTERM)
            elif target == "its group":  # kill -TERM -PGID: the launcher and every process it started at once
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            break
    code = proc.wait(timeout=300)
    lines += proc.stdout.readlines()  # until every process holding the pipe (a rank left behind, too) has ended
    return exit_status(code), "".join(lines)


def rank_trains(args: list[str]) -> None:
    from finetune.tools.train import main

    assert main(args) == 0


def trained(args: list[str], ranks: int, capfd) -> None:
    """finetune/train.py ARGS to the end: in this process, or on two forked gloo ranks."""
    if ranks == 1:
        result = call(capfd, args, **RUN_ENV)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        forked_ranks(rank_trains, args, ACCELERATE_USE_CPU="true")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The whole run on one rank and on two, trained once each: what every resumed cell must equal bitwise."""
    runs = {}

    def run_of(ranks: int, capfd) -> Path:
        if ranks not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{ranks}") / "out"
            trained([*BASE, f"train.max_steps={STEPS}", f"train.output_dir={out}"], ranks, capfd)
            runs[ranks] = out
        return runs[ranks]

    return run_of


@pytest.mark.slow  # the launcher x signal matrix: real launchers, their fresh interpreters and ranks, each resumed
@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.parametrize("launcher, target, code, why", CELLS, ids=[f"{c[0]}, to {c[1]}" for c in CELLS])
def test_sigterm_saves_exits_with_the_documented_code_and_resumes_bitwise(
    launcher, target, code, why, uninterrupted, tmp_path, capfd, request
):
    command, ranks = LAUNCHERS[launcher]
    if target == "PID 1":
        request.getfixturevalue("pid_namespace")
    out = tmp_path / "out"
    args = [*BASE, f"train.max_steps={STEPS}", f"train.output_dir={out}"]
    with turn_at_the_cores():
        ended, output = stopped([*command, *args], target, f"step 2/{STEPS}")
    lines = re.findall(rf"^stopped by {why} after optimizer step (\d+) of {STEPS}; checkpoint: (\S+)$", output, re.M)
    assert len(lines) == 1, output[-4000:]
    step, checkpoint = lines[0]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{step}"] == [Path(checkpoint).name]
    assert not (out / "model.safetensors").exists(), output[-4000:]
    # no traceback through the project (torchrun prints its own for the signal it forwarded)
    assert f'File "{ROOT / "finetune"}' not in output, output[-4000:]
    assert ended == code, output[-4000:]
    reference = uninterrupted(ranks, capfd)
    trained([*args, "train.resume_from=auto"], ranks, capfd)
    assert_same_run(out, reference)


@pytest.mark.slow  # `accelerate launch` of one process as PID 1 of a PID namespace: the launcher is the behaviour
@pytest.mark.e2e
@pytest.mark.subprocess
def test_a_one_process_accelerate_launch_as_pid_1_warns_once_with_the_command_to_run(pid_namespace, tmp_path):
    """Its launcher installs no SIGTERM handler, so as PID 1 the kernel drops a container's stop; the run says so at
    start-up and names the command that would save."""
    args = [*BASE, "train.max_steps=1", f"train.output_dir={tmp_path / 'out'}"]
    result = subprocess.run(
        [*UNSHARE, *ONE_RANK, "finetune/train.py", *args],
        cwd=ROOT,
        env={**ENV, "PYTHONPATH": ON_PATH},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if "does not catch SIGTERM" in line]
    assert len(warnings) == 1, result.stdout[-3000:]
    assert warnings[0].startswith("warning: this run's parent, PID 1 (") and "accelerate" in warnings[0]
    assert f"`python finetune/train.py {' '.join(args)}`" in warnings[0]


def pod_outcome(job: dict, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    """What Kubernetes does with a Job's pod whose container `train` ended with `exit_code`: its podFailurePolicy's
    rules in order, the first that matches deciding (FailJob, Ignore: a new pod, not counted against backoffLimit;
    Count), no match: Count; exit 0: the pod succeeded and the Job is Complete."""
    if exit_code == 0:
        return "Complete"
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is not None and codes.get("containerName", "train") == "train":
            matched = exit_code in codes["values"]
            if matched == (codes["operator"] == "In"):
                return rule["action"]
        if any(c["type"] in conditions for c in rule.get("onPodConditions", ())):
            return rule["action"]
    return "Count"


def test_the_kubernetes_example_retries_every_stop_uncounted_and_never_completes_an_unfinished_run():
    """docs/examples/k8s-job.yaml's podFailurePolicy over the codes the PID-1 cells above end with. Its command
    (finetune-launch torchrun) ends a saved stop with 143 (130 for Ctrl-C): a new pod, not counted against
    backoffLimit; so do finetune-train and python as PID 1. Bare torchrun's 1 after a stop would be counted (as a
    crash is, unless the pod was evicted). A bad recipe (2) and a non-finite stop (3) fail the Job; only a finished
    run (0) completes it."""
    import yaml

    job = yaml.safe_load((ROOT / "docs" / "examples" / "k8s-job.yaml").read_text())
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["finetune-launch", "torchrun"]  # the matrix's "finetune-launch torchrun"
    pid1 = {launcher: code for launcher, target, code, _ in CELLS if target == "PID 1"}
    assert pid1["finetune-launch torchrun"] == pid1["finetune-train"] == STOPPED
    for launcher, code in pid1.items():  # a stop is retried, never Complete; an eviction is never counted
        assert pod_outcome(job, code) == ("Ignore" if code == STOPPED else "Count"), launcher
        assert pod_outcome(job, code, ("DisruptionTarget",)) == "Ignore", launcher
    assert pod_outcome(job, STOPPED_BY[signal.SIGINT]) == "Ignore"
    assert pod_outcome(job, 2) == pod_outcome(job, 3) == "FailJob"
    assert pod_outcome(job, 70) == "Count"  # a bug: retried up to backoffLimit
    assert pod_outcome(job, 0) == "Complete"
