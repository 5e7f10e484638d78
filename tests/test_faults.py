"""Faults during a run: streamed runs stopped and resumed, saves that fail, machine faults at the boundary, changed
recipes and data at resume, W&B without a network, signals however the run was launched.

Every run here is the command a user runs on the debug recipe, stopped at a chosen moment: in this process (`call`)
where the behaviour is the run's files and lines; a process of its own where it is the process's (a signal, a file
size limit, a dead peer, a launcher): forked from this one (tests/forks.py) unless the launcher is the
behaviour."""

import errno
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.forks import forked, forked_signalled, script
from tests.launch import (
    ENV,
    ON_PATH,
    ROOT,
    STOPPED_BY,
    assert_same_run,
    call,
    forked_ranks,
    free_port,
    process_logs,
    turn_at_the_cores,
)

BASE = ["recipe=recipes/debug.yaml", "data.limit=16", "data.max_length=64", "log.wandb_mode=disabled"]
STREAM = [*BASE, "data.streaming=true", "train.max_steps=6"]  # 2 optimizer steps per pass: 3 passes


RUN_ENV = {"OMP_NUM_THREADS": ENV["OMP_NUM_THREADS"], "WANDB_MODE": ENV["WANDB_MODE"]}  # as a launched run has them


@pytest.fixture(autouse=True)
def threads_restored():
    """A run in this process sets torch's thread count from OMP_NUM_THREADS (1, as the processes here have it: runs
    compared bit for bit must reduce alike); the tests after it keep their own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run(capfd, args: list[str], environ: dict = RUN_ENV) -> subprocess.CompletedProcess:
    """finetune/train.py ARGS, called in this process with `environ` set; its library warnings reach its stderr as in
    a process."""
    with process_logs():
        return call(capfd, args, **environ)


def trained(args: list[str]) -> None:
    """finetune/train.py ARGS in this process, for a fixture several tests share (no capfd there): it must succeed."""
    from finetune.tools.train import main

    with pytest.MonkeyPatch.context() as env:
        for key, value in RUN_ENV.items():
            env.setenv(key, value)
        env.chdir(ROOT)
        assert main(args) == 0


def checkpoint_names(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


# ---- 1. streamed runs checkpoint and resume exactly ----


@pytest.mark.e2e
@pytest.mark.subprocess
def test_a_streamed_run_stopped_twice_resumes_bitwise(tmp_path, capfd):
    reference = tmp_path / "reference"
    done = run(capfd, [*STREAM, "train.save_steps=2", f"train.output_dir={reference}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint_names(reference) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    state = json.loads((reference / "checkpoint-4" / "finetune_state.json").read_text())
    assert state["data_position"]["dataset_items"] == "stream"

    out = tmp_path / "stopped"
    args = [*STREAM, "train.save_steps=2", f"train.output_dir={out}", "train.resume_from=auto"]
    code, stdout, _ = forked_signalled(args, signal.SIGTERM, "step 1/6")  # mid-pass, before the first checkpoint
    assert code == STOPPED_BY[signal.SIGTERM] and "stopped by SIGTERM" in stdout, stdout[-3000:]
    first = checkpoint_names(out)
    # the stop lands at the next micro-batch and saves the last optimizer step: step 1 (or a later one on a slow CPU)
    assert first and first[-1] in ("checkpoint-1", "checkpoint-2", "checkpoint-3"), first
    code, stdout, _ = forked_signalled(args, signal.SIGTERM, "step 4/6")  # the second and third passes
    assert code == STOPPED_BY[signal.SIGTERM] and f"resuming from {out / first[-1]}" in stdout, stdout[-3000:]
    assert "stopped by SIGTERM" in stdout, stdout[-3000:]
    finished = run(capfd, args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_same_run(out, reference)
    for name in checkpoint_names(out):  # every checkpoint of the chain equals the reference's at its step
        if (reference / name).is_dir():
            assert_same_run(out / name, reference / name)
    assert not (out / ".staging").exists()


def rank_trains(args: list[str]) -> None:
    """finetune/train.py ARGS on a rank of forked_ranks: it must exit 0."""
    from finetune.tools.train import main

    assert main(args) == 0


@pytest.mark.e2e
@pytest.mark.distributed
def test_a_streamed_run_on_two_ranks_resumes_bitwise(tmp_path, capfd):
    args = [*BASE, "data.streaming=true", "train.max_steps=4", "train.save_steps=1"]
    reference = tmp_path / "reference"
    forked_ranks(rank_trains, [*args, f"train.output_dir={reference}"])
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-1", out / "checkpoint-1")  # 2 ranks × 4 rows of 16: mid-pass
    capfd.readouterr()
    forked_ranks(rank_trains, [*args, f"train.output_dir={out}", "train.resume_from=auto"])
    assert f"resuming from {out / 'checkpoint-1'}" in capfd.readouterr().out
    assert_same_run(out, reference)


# ---- 2. one boundary rule: faults of the machine or a peer are one line, exit 2, never "a bug" ----


def limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def assert_fault_line(result: subprocess.CompletedProcess, pattern: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "a bug in finetune" not in result.stderr


@pytest.mark.subprocess
def test_a_file_size_limit_hit_in_torch_save_is_one_line_and_leaves_no_staging(tmp_path, capfd):
    out = tmp_path / "out"  # model.safetensors (12.6 MB) fits under 20 MB, optimizer.pt (25 MB, torch.save) does not
    args = [*BASE, "train.max_steps=2", "train.save_steps=1", f"train.output_dir={out}"]
    result = forked(capfd, script, args, before=limit_file_size(20 * 2**20))  # the limit: the child process's own
    assert_fault_line(
        result,
        r"^error: train\.output_dir=\S+: writing checkpoint-1 failed \(torch\.save could not "
        r"write its file: File too large\); a file grew past this process's file size limit "
        r"\(ulimit -f\); raise it",
    )
    assert not out.exists() or not list(out.rglob("*.safetensors"))  # no staging, no checkpoint


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB tmpfs (root only): one checkpoint of the debug model fits (41 MB), two do not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_full_disk_while_torch_save_writes_is_one_line_with_disk_advice(small_disk, capfd):
    out = small_disk / "out"
    result = run(capfd, [*BASE, "train.max_steps=2", "train.save_steps=1", f"train.output_dir={out}"])
    assert_fault_line(
        result,
        r"^error: train\.output_dir=\S+: writing checkpoint-2 failed \((torch\.save could not "
        r"write its file: )?No space left on device\); the disk is full; free space there",
    )
    assert not (out / ".staging").exists() and checkpoint_names(out) == ["checkpoint-1"]  # the older one stays
    assert os.statvfs(small_disk).f_bfree * os.statvfs(small_disk).f_frsize > 20 * 2**20  # nothing half-written left


def test_a_read_only_file_system_under_a_save_is_told_so(tmp_path, capfd):
    out = tmp_path / "out"
    staging = out / ".staging"  # where checkpoints are written first: a read-only file system
    staging.mkdir(parents=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(staging)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        result = run(capfd, [*BASE, "train.max_steps=2", "train.save_steps=1", f"train.output_dir={out}"])
    finally:
        subprocess.run(["umount", "-l", str(staging)], capture_output=True)
    assert_fault_line(
        result,
        r"^error: train\.output_dir=\S+: writing checkpoint-1 failed \(Read-only file system\); "
        r"the file system is read-only \(a disk error can remount it so\); choose a writable",
    )


@pytest.mark.parametrize(
    "error, pattern",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/x/optimizer.pt"),
            r"^/x/optimizer\.pt: No space left on device; the disk is full",
        ),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "/x/a"), r"Disk quota exceeded; your disk quota is used up"),
        (OSError(errno.EROFS, "Read-only file system", "/x/a"), r"Read-only file system; the file system is read-only"),
        (OSError(errno.EACCES, "Permission denied", "/x/a"), r"Permission denied; no permission for it; fix"),
        (MemoryError(), r"^out of host memory \(MemoryError\)"),
        (
            RuntimeError("Connection closed by peer [127.0.0.1]:41234"),
            r"^lost another rank \(Connection closed by peer ",
        ),
    ],
)
def test_machine_and_peer_faults_are_classified_with_matching_advice(error, pattern):
    from finetune.tools.boundary import machine_fault

    assert re.search(pattern, machine_fault(error))
    assert machine_fault(ValueError("a bug")) is None and machine_fault(OSError(errno.ENOENT, "x")) is None


def test_a_real_host_allocation_failure_is_out_of_host_memory():
    import torch

    from finetune.tools.boundary import machine_fault

    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte: DefaultCPUAllocator refuses it
    assert machine_fault(caught.value).startswith("out of host memory (")


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.distributed
def test_a_rank_whose_peer_dies_names_it_in_one_line(tmp_path):
    """Two launchers of one rank each (as two machines): rank 1 is killed after step 2; rank 0 is not killed by its
    own launcher, so it meets the dead peer in a collective and says so."""
    port, out = free_port(), tmp_path / "out"
    with turn_at_the_cores():
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    f"--node_rank={r}",
                    "--nproc_per_node=1",
                    "--master_addr=127.0.0.1",
                    f"--master_port={port}",
                    "tests/workers/fault_worker.py",
                    "die:1:2",
                    *BASE,
                    "train.max_steps=6",
                    f"train.output_dir={out}",
                ],
                cwd=ROOT,
                env={**ENV, "PYTHONPATH": ON_PATH},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        (_, survivor), _ = (p.communicate(timeout=600) for p in procs)
    errors = [line for line in survivor.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, survivor[-3000:]
    assert re.match(
        r"error: rank 0: lost rank 1 \(.*(Connection (reset|closed) by peer|Broken pipe).*\): rank 1 "
        r"stopped first \(killed, out of memory, or its machine failed\); .* train\.resume_from=auto$",
        errors[0],
    ), errors[0]
    assert "exitcode  : 2" in survivor and "a bug in finetune" not in survivor


# ---- 3. the recipe that trained, in each checkpoint, compared at resume ----


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A run of 4 steps at lr 1e-3 with a checkpoint after each step."""
    out = tmp_path_factory.mktemp("four") / "out"
    trained([*BASE, "train.max_steps=4", "train.save_steps=1", f"train.output_dir={out}"])
    return out


def from_checkpoint(run_dir: Path, step: int, tmp_path: Path) -> Path:
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(run_dir / f"checkpoint-{step}", out / f"checkpoint-{step}")
    return out


@pytest.mark.e2e
def test_a_new_lr_at_resume_is_applied_to_the_optimizer_and_stated_once(four_steps, tmp_path, capfd):
    from safetensors.torch import load_file

    assert (four_steps / "checkpoint-2" / "recipe.yaml").read_text().count("lr: 0.001") == 1
    out = from_checkpoint(four_steps, 2, tmp_path)
    result = run(
        capfd,
        [
            *BASE,
            "train.max_steps=4",
            "train.save_steps=1",
            f"train.output_dir={out}",
            "train.resume_from=auto",
            "optim.lr=5e-4",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: resuming with")]
    assert warnings == [
        "warning: resuming with optim.lr 0.001 → 0.0005: applied from optimizer step 3 (the optimizer "
        "and scheduler take them; steps 1-2 trained with the recorded values, and recipe.yaml says so)"
    ]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["learning_rate"] for e in history if "loss" in e] == [1e-3, 1e-3, 5e-4, 5e-4]
    # AdamW (no weight decay) from the same state and gradient moves each weight by lr × m/(√v+ε): half of step 3's
    # move at 1e-3 in the uninterrupted run
    before, at_1e3 = (
        load_file(four_steps / "checkpoint-2" / "model.safetensors"),
        load_file(four_steps / "checkpoint-3" / "model.safetensors"),
    )
    at_5e4 = load_file(out / "checkpoint-3" / "model.safetensors")
    for name in before:
        torch.testing.assert_close(
            at_5e4[name] - before[name], 0.5 * (at_1e3[name] - before[name]), rtol=1e-4, atol=1e-7
        )
    recipe = (out / "recipe.yaml").read_text()
    assert recipe.startswith("# resumed at optimizer step 2: optim.lr 0.001 → 0.0005\n") and "lr: 0.0005" in recipe
    assert (out / "checkpoint-4" / "recipe.yaml").read_text() == recipe


@pytest.mark.e2e
@pytest.mark.parametrize(
    "change, message",
    [
        (
            "optim.name=sgd",
            r"was trained with optim\.name=adamw, this run has optim\.name=sgd; resume with the recipe "
            r"that wrote it, or start fresh in another train\.output_dir$",
        ),
        (
            "model.dtype=bfloat16",
            r"was trained with model\.dtype=float32, this run has model\.dtype=bfloat16; resume with the recipe",
        ),
        (
            "data.loss_on=all",
            r"was trained with data\.loss_on=assistant, this run has data\.loss_on=all \(other rows\); "
            r"set it as that run had it, or set train\.resume_data_order_change=allow$",
        ),
    ],
)
def test_a_changed_key_that_cannot_continue_is_refused_naming_both_values(change, message, four_steps, tmp_path, capfd):
    out = from_checkpoint(four_steps, 2, tmp_path)
    result = run(capfd, [*BASE, "train.max_steps=4", f"train.output_dir={out}", "train.resume_from=auto", change])
    assert_fault_line(result, r"^error: train\.resume_from: \S+checkpoint-2 " + message)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]


# ---- 4. other data of the same row count ----


def chat_rows(path: Path, answers: list[str]) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"question {k}?"}, {"role": "assistant", "content": a}]}
            )
            + "\n"
            for k, a in enumerate(answers)
        )
    )
    return path


def test_the_fingerprint_covers_every_row_and_not_the_chunking():
    import datasets

    from finetune.training.resume_checks import data_fingerprint

    rows = {
        "input_ids": [list(range(k % 7, k % 7 + 9)) for k in range(600)],
        "labels": [[-100] * 3 + list(range(6)) for _ in range(600)],
    }
    whole = datasets.Dataset.from_dict(rows)
    chunked = datasets.concatenate_datasets(
        [
            datasets.Dataset.from_dict({k: v[:250] for k, v in rows.items()}),
            datasets.Dataset.from_dict({k: v[250:] for k, v in rows.items()}),
        ]
    )
    assert chunked.data.column("input_ids").num_chunks == 2 and data_fingerprint(whole) == data_fingerprint(chunked)
    rows["labels"][417][5] = -100  # one label of one row in the middle
    assert data_fingerprint(datasets.Dataset.from_dict(rows)) != data_fingerprint(whole)


@pytest.mark.e2e
@pytest.mark.parametrize("streaming", [False, True], ids=["in memory", "streamed"])
def test_a_rewritten_data_file_of_the_same_row_count_is_refused_unless_allowed(streaming, tmp_path, capfd):
    data = chat_rows(tmp_path / "rows.jsonl", [f"answer number {k}." for k in range(16)])
    out = tmp_path / "out"
    args = [
        *BASE,
        f"data.source={data}",
        "train.max_steps=3",
        f"train.output_dir={out}",
        f"data.streaming={str(streaming).lower()}",
    ]
    first = run(capfd, [*args, "train.save_steps=1", "train.max_steps=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    chat_rows(data, [f"answer number {k}." if k != 3 else "another answer." for k in range(16)])  # one row changed
    refused = run(capfd, [*args, "train.resume_from=auto"])
    assert_fault_line(
        refused,
        r"^error: train\.resume_from: resuming with data_fingerprint [0-9a-f]{16} → "
        r"[0-9a-f]{16} would train on another data order and position .*set data\.source \(its "
        r"rows as read differ: the file was rewritten, or another one named\) as that run had "
        r"them, or set train\.resume_data_order_change=allow",
    )
    allowed = run(capfd, [*args, "train.resume_from=auto", "train.resume_data_order_change=allow"])
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "resuming with data_fingerprint" in allowed.stderr  # the warning


# ---- 5. W&B: auto goes online only when the service answers; online without a key or network is one line ----


@pytest.fixture
def silent_service():
    """A loopback port that accepts connections and never answers (a network that swallows packets)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def wandb_env(monkeypatch, tmp_path: Path, url: str, key: bool) -> None:
    """A HOME without ~/.netrc, the W&B service at `url`, WANDB_MODE unset, an API key or none; what a run sets of
    W&B's variables is undone after the test."""
    import finetune.tools.train  # noqa: F401  (the libraries read their cache folders from HOME once, at import)
    from finetune.env import cache_dir

    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_SILENT", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FINETUNE_CACHE", str(cache_dir()))  # the tokenizer converted once stays found: HOME moves
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_BASE_URL", url)
    if key:
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)


@pytest.mark.e2e
def test_wandb_auto_with_a_key_and_no_answer_logs_offline_after_one_warning(
    silent_service, tmp_path, monkeypatch, capfd
):
    out = tmp_path / "out"
    wandb_env(monkeypatch, tmp_path, silent_service, key=True)
    args = [*BASE, "log.wandb_mode=auto", "train.max_steps=1", f"train.output_dir={out}"]
    result = run(capfd, args, {"OMP_NUM_THREADS": ENV["OMP_NUM_THREADS"]})  # WANDB_MODE unset
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: log.wandb_mode=auto")]
    assert warnings == [
        f"warning: log.wandb_mode=auto: the W&B service {silent_service} did not answer within 3 s "
        "(timed out); logging offline (upload later with `wandb sync`)"
    ], result.stderr[-3000:]
    assert list((out / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize(
    "key, message",
    [
        (
            False,
            r"^error: log\.wandb_mode=online needs a W&B API key \(WANDB_API_KEY, or `wandb login`\); log in, or set "
            r"log\.wandb_mode=offline",
        ),
        (
            True,
            r"^error: log\.wandb_mode=online: the W&B service http://127\.0\.0\.1:\d+ did not answer within 3 s \(.*"
            r"refused.*\); check the network \(or WANDB_BASE_URL\), or set log\.wandb_mode=offline",
        ),
    ],
    ids=["no key", "no network"],
)
def test_wandb_online_without_a_key_or_a_network_is_one_line_and_writes_nothing(
    key, message, tmp_path, monkeypatch, capfd
):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: refused at once
    out = tmp_path / "out"
    wandb_env(monkeypatch, tmp_path, url, key)
    args = [*BASE, "log.wandb_mode=online", f"train.output_dir={out}"]
    result = run(capfd, args, {"OMP_NUM_THREADS": ENV["OMP_NUM_THREADS"]})  # WANDB_MODE unset
    assert_fault_line(result, message)
    assert not out.exists()


# ---- 6. signals: during an evaluation, and to a launcher ----


@pytest.mark.e2e
@pytest.mark.subprocess
def test_sigterm_during_an_evaluation_ends_it_at_the_next_batch_and_saves_that_step(tmp_path):
    held = chat_rows(tmp_path / "eval.jsonl", [f"held-out answer {k} " * 6 for k in range(300)])
    out = tmp_path / "out"
    args = [
        *BASE,
        "train.max_steps=4",
        f"train.output_dir={out}",
        f"eval.source={held}",
        "eval.every_steps=2",
        "eval.micro_batch_size=4",
        "eval.samples=1",
    ]
    # sent once "step 2/4" is printed: the evaluation after step 2 (75 batches) starts now
    code, stdout, _ = forked_signalled(args, signal.SIGTERM, "step 2/4", merge=True)
    assert code == STOPPED_BY[signal.SIGTERM], stdout[-3000:]
    assert "stopped by SIGTERM after optimizer step 2 of 4" in stdout, stdout[-3000:]  # not after step 3
    assert checkpoint_names(out) == ["checkpoint-2"]
    history = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "eval_loss" in e] == [0]  # the evaluation before step 1, not the cut one


# ---- 7. a resume reads as the same run: no tied-head warning, whole-run figures ----


def train_loss(folder: Path) -> float:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return next(e["train_loss"] for e in reversed(history) if "train_loss" in e)


@pytest.mark.e2e
@pytest.mark.parametrize("start", [2, 4], ids=["mid-run", "nothing left"])
def test_a_resumed_run_reports_the_whole_runs_train_loss_and_no_missing_tied_head(start, four_steps, tmp_path, capfd):
    out = from_checkpoint(four_steps, start, tmp_path)
    result = run(capfd, [*BASE, "train.max_steps=4", f"train.output_dir={out}", "train.resume_from=auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "missing keys" not in result.stderr and "lm_head" not in result.stderr
    assert train_loss(out) == train_loss(four_steps) > 0  # bitwise: the same sum in the same order
    table = result.stdout[result.stdout.index("done:") :]
    assert re.search(rf"optimizer steps +4 \(resumed after step {start}\)", table), table
    assert re.search(rf"train loss +{train_loss(four_steps):.4f} \(mean over all 4 steps\)", table), table
    if start == 2:
        assert re.search(r"real tokens +[\d,]+ \([\d,]+ targets\) in this process \(steps 3-4\)", table), table


def test_a_stop_before_the_first_step_names_no_checkpoint_that_does_not_exist(tmp_path):
    """SIGTERM during the evaluation before step 1: nothing was trained or saved; the message says so, and a stop
    after a step names the checkpoint that step wrote."""
    from types import SimpleNamespace

    from finetune.training.lifecycle import StopRequest, stopped_message

    stop = StopRequest()
    stop.signal_name = "SIGTERM"
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=0, max_steps=4), args=SimpleNamespace(output_dir=str(tmp_path))
    )
    text = stopped_message(stop, trainer, ["recipe=debug"])
    assert "before optimizer step 1 of 4; nothing trained, no checkpoint written" in text
    assert "checkpoint-0" not in text and "train.resume_from=auto" in text
    (tmp_path / "checkpoint-2").mkdir()
    trainer.state.global_step = 2
    assert f"after optimizer step 2 of 4; checkpoint: {tmp_path / 'checkpoint-2'}" in stopped_message(stop, trainer, [])


def test_catches_sigterm_reads_the_sigcgt_mask():
    from finetune.training.lifecycle import catches_sigterm

    assert not catches_sigterm("Name:\tpython\nSigIgn:\t0000000001001000\nSigCgt:\t0000000000000002\n")  # SIGINT only
    assert catches_sigterm("SigCgt:\t0000000000004002\n")  # bit 14: signal 15
    assert catches_sigterm("SigCgt:\t0000000180004a02\n")
    assert not catches_sigterm("SigCgt:\t0000000180000a02\n")


def test_one_stop_per_stop_the_launchers_exit_and_a_repeat_are_not_a_second_request(monkeypatch):
    """A stop signal arms one stop (exit 128 + its number); the launcher's death (its own parent-death signal) and the
    same stop delivered again (a process group's signal passed on by its launcher) do not stop at once; a stop signal
    after SAME_STOP_S is a real second request: Ctrl-C again raises at once."""
    from finetune.training import lifecycle

    now = [100.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: now[0])
    killed = []
    monkeypatch.setattr(lifecycle.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(lifecycle.signal, "signal", lambda sig, handler: None)

    stop = lifecycle.StopRequest()
    stop._handle(signal.SIGTERM, None)
    assert stop.requested and stop.signal_name == "SIGTERM" and stop.exit_code == 143
    stop._launcher_gone(lifecycle.LAUNCHER_GONE, None)  # the launcher died of the same group signal
    now[0] += lifecycle.SAME_STOP_S / 2
    stop._handle(signal.SIGTERM, None)  # torchrun passes the group's SIGTERM on
    stop._handle(signal.SIGINT, None)
    assert killed == [] and stop.signal_name == "SIGTERM" and stop.exit_code == 143
    now[0] += lifecycle.SAME_STOP_S
    stop._handle(signal.SIGTERM, None)  # a second request: SIGTERM's default action, at once
    assert killed == [signal.SIGTERM]
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)

    gone = lifecycle.StopRequest()
    gone._launcher_gone(lifecycle.LAUNCHER_GONE, None)  # the launcher alone was killed: stop and save
    assert gone.requested and gone.signal_name == "the launcher's exit" and gone.exit_code == 143
    interrupted = lifecycle.StopRequest()
    interrupted._handle(signal.SIGINT, None)
    assert interrupted.exit_code == 130
    assert lifecycle.LAUNCHER_GONE not in (signal.SIGTERM, signal.SIGINT)


def test_a_save_cut_short_is_removed_at_the_next_start_which_says_so(tmp_path, capsys):
    """A second stop request (or a kill) in the middle of a checkpoint's save leaves it in the staging folder, never in
    place of a whole checkpoint: the next start on the folder removes it and names it; whole checkpoints stay."""
    from finetune.training import output_dir
    from finetune.training.staging import STAGING

    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "model.safetensors").write_bytes(b"whole")
    (out / STAGING / "checkpoint-6").mkdir(parents=True)
    (out / STAGING / "checkpoint-6" / "optimizer.pt").write_bytes(b"half")
    with output_dir.claimed(str(out)):
        pass
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"note: {out}: a save was stopped before it was whole (checkpoint-6 in {STAGING}); removed it, the whole "
        "checkpoints are as they were"
    ]
    assert not (out / STAGING).exists() and (out / "checkpoint-4" / "model.safetensors").read_bytes() == b"whole"
    with output_dir.claimed(str(out)):  # nothing left: nothing said
        pass
    assert capsys.readouterr().out == ""
