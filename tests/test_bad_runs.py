"""Runs: one run per train.output_dir (a lock a killed run does not leave stale), a final save that never leaves a
folder mixing two runs whenever the process dies, checkpoints and model folders whose cut or damaged files are named
file by file (resume_from=auto falls back to the newest whole checkpoint), a resume that would change the data order
refused unless allowed, and an error after the progress bar on a line of its own."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from finetune.model.loading import check_folder
from finetune.recipe import ModelConfig, RecipeError
from finetune.training import checkpoint_files, output_dir
from finetune.training.output_dir import CARRIED, FINAL_SET, OutputLock, recover, sibling, swap_in
from tests.launch import ENV, ROOT, assert_one_error, call

BASE = [
    "recipe=recipes/debug.yaml",
    "data.limit=16",
    "data.max_length=64",
    "train.max_steps=2",
    "log.wandb_mode=disabled",
]
HOLD = (
    "import sys, time\nfrom finetune.training.output_dir import OutputLock\nlock = OutputLock(sys.argv[1])\n"
    "lock.acquire()\nprint('held', flush=True)\ntime.sleep(600)\n"
)


def train(*args: str, code: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "finetune/train.py"]
    base = [a for a in BASE if not (a.startswith("recipe=") and any(b.startswith("recipe=") for b in args))]
    return subprocess.run(
        [*cmd, *base, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env={**ENV, **(env or {})}
    )


def train_here(capfd, *args: str) -> subprocess.CompletedProcess:
    """`train`'s command called in this process."""
    base = [a for a in BASE if not (a.startswith("recipe=") and any(b.startswith("recipe=") for b in args))]
    return call(capfd, [*base, *args])


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


# ---- one run per output_dir ----


def hold_lock(out: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.subprocess
def test_a_second_run_on_an_output_dir_in_use_is_refused_and_a_killed_holder_leaves_no_stale_lock(tmp_path, capfd):
    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        lock = OutputLock(str(out))
        with pytest.raises(
            RecipeError,
            match=rf"train\.output_dir={out} is in use by another run \(pid {holder.pid} "
            r"on \S+, since [\d-]+ [\d:]+\); wait for it to end, or choose",
        ):
            lock.acquire()
        before = snapshot(out)
        result = train_here(capfd, f"train.output_dir={out}")
        assert_one_error(result, rf"^error: train\.output_dir={out} is in use by another run \(pid {holder.pid} ")
        assert snapshot(out) == before  # nothing written by the refused run
    finally:
        holder.send_signal(signal.SIGKILL)  # kill -9: the OS drops the holder's flock
        holder.wait()
    lock.acquire()  # not stale
    lock.release()
    assert not (out / ".lock").exists()


def test_a_lock_of_a_run_that_fails_early_leaves_nothing(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RecipeError, match="boom"), output_dir.claimed(str(out)):
        assert (out / ".lock").is_file()
        raise RecipeError("boom")
    assert not (tmp_path / "a").exists()  # the folders the lock made are gone again


# ---- the final save: whole sets, swapped ----


def final_set(folder: Path, tag: str, names: tuple[str, ...]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text(tag)


OLD = ("adapter_config.json", "adapter_model.safetensors", "config.json", "recipe.yaml", "trainer_state.json")
NEW = ("config.json", "model.safetensors", "recipe.yaml", "trainer_state.json")


def which_run(out: Path) -> str:
    """old or new when the folder holds exactly one run's final set; fails on a mix."""
    tags = {(out / name).read_text() for name in set(OLD) | set(NEW) if (out / name).is_file()}
    assert len(tags) == 1, f"a mix of two runs: {sorted(p.name for p in out.iterdir())}"
    tag = tags.pop()
    names = {p.name for p in out.iterdir() if p.is_file() and p.name in set(OLD) | set(NEW)}
    assert names == set(OLD if tag == "old" else NEW), names
    return tag


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash_at", range(1, 9))
@pytest.mark.parametrize("manifest", [True, False], ids=["previous set named", "previous set of an older version"])
@pytest.mark.parametrize("exchange", ["renameat2", "three renames"])
def test_a_final_save_killed_at_any_rename_leaves_one_run_and_the_next_run_cleans_up(
    crash_at, manifest, exchange, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    final_set(out, "old", OLD)
    if manifest:
        (out / FINAL_SET).write_text(json.dumps(OLD))
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "optimizer.pt").write_text("state")
    (out / "notes.txt").write_text("mine")
    final_set(sibling(str(out)), "new", NEW)
    real_replace, real_exchange, calls = os.replace, output_dir._exchange, []

    def count(step):  # every rename is a point where the process may die
        calls.append(1)
        if len(calls) == crash_at:
            raise Crash
        return step()

    monkeypatch.setattr(os, "replace", lambda a, b: count(lambda: real_replace(a, b)))
    monkeypatch.setattr(output_dir, "_exchange", lambda a, b: count(lambda: real_exchange(a, b)))
    if exchange == "three renames":  # where renameat2 is missing: the folder is briefly absent, never mixed
        monkeypatch.setattr(sys, "platform", "other")
    try:
        swap_in(str(out), sibling(str(out)))
        finished = True
    except Crash:
        finished = False
    monkeypatch.undo()
    assert not out.exists() or which_run(out) in ("old", "new")
    recover(str(out))
    assert which_run(out) == "new" if finished else which_run(out) in ("old", "new")
    assert (out / "checkpoint-1" / "optimizer.pt").read_text() == "state" and (out / "notes.txt").is_file()
    assert not sibling(str(out)).exists() and not (out / CARRIED).exists()
    if finished:
        assert json.loads((out / FINAL_SET).read_text()) == sorted(NEW)


@pytest.mark.e2e
@pytest.mark.subprocess
def test_a_run_over_an_older_run_replaces_its_model_whole_and_keeps_its_checkpoints(tmp_path, capfd):
    out = tmp_path / "out"
    first = train_here(capfd, "model.lora.enabled=true", "train.save_steps=1", f"train.output_dir={out}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "adapter_config.json").is_file()
    killer = (
        "import os, signal, sys\nreal = os.replace\nmoved = [0]\n"
        "def replace(a, b):\n    real(a, b)\n    if '.out.final' in str(b):\n        moved[0] += 1\n"
        "        if moved[0] == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.replace = replace\nfrom finetune.tools.train import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    killed = train(f"train.output_dir={out}", code=killer)  # killed with the checkpoints moved beside, not swapped
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (out / "adapter_config.json").is_file() and not (out / "checkpoint-1").exists()  # the old run, whole
    again = train_here(capfd, f"train.output_dir={out}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "a final save was interrupted; cleaned up (2 entries moved back: checkpoint-1, checkpoint-2)" in again.stdout
    assert not [p.name for p in out.iterdir() if p.name.startswith("adapter_")]  # nothing of the LoRA run is left
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert not sibling(str(out)).exists() and not (out / ".lock").exists()


# ---- checkpoints and model folders: every damaged file named ----


def checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(64, 64)}, str(folder / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.zeros(64, 64)}}}, folder / "optimizer.pt")
    torch.save({"cpu": torch.zeros(16)}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": [{"loss": 1.0}] * 20}))
    checkpoint_files.record_sizes(str(folder))
    (folder / "finetune_state.json").write_text(json.dumps({"nonfinite_skipped": 0}))
    return folder


def cut(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


@pytest.mark.parametrize(
    "name, why",
    [
        ("model.safetensors", r"model\.safetensors: [\d,]+ bytes, written as 16,4\d\d"),
        ("optimizer.pt", r"optimizer\.pt: [\d,]+ bytes, written as"),
        ("rng_state.pth", r"rng_state\.pth: [\d,]+ bytes, written as"),
        ("trainer_state.json", r"trainer_state\.json: [\d,]+ bytes, written as"),
        ("finetune_state.json", r"finetune_state\.json: not a whole JSON"),
        ("checkpoint_files.json", r"checkpoint_files\.json: unreadable"),
    ],
)
def test_a_cut_checkpoint_file_is_named(name, why, tmp_path):
    folder = checkpoint(tmp_path / "checkpoint-2")
    assert checkpoint_files.damaged(str(folder)) == []
    cut(folder / name)
    with pytest.raises(RecipeError, match=rf"train\.resume_from=\S+checkpoint-2 is damaged: .*{why}"):
        checkpoint_files.check_whole(str(folder))


def test_files_are_judged_by_their_kind_without_recorded_sizes(tmp_path):
    folder = checkpoint(tmp_path / "checkpoint-2")
    (folder / checkpoint_files.SIZES).unlink()  # written by an older version
    cut(folder / "model.safetensors")
    cut(folder / "optimizer.pt")
    problems = checkpoint_files.damaged(str(folder))
    assert problems[0].startswith("model.safetensors: cut short (8,") and "of 16,4" in problems[0]
    assert problems[1].startswith("optimizer.pt: not a whole torch file")


def test_resume_auto_falls_back_to_the_newest_whole_checkpoint_with_a_warning(tmp_path, capsys):
    from finetune.recipe import TrainConfig
    from finetune.training import checkpoints

    older, newest = checkpoint(tmp_path / "checkpoint-1"), checkpoint(tmp_path / "checkpoint-2")
    cut(newest / "optimizer.pt")
    train_cfg = TrainConfig(output_dir=str(tmp_path), resume_from="auto")
    assert checkpoints.resume_path(train_cfg) == str(older)
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: {newest} is damaged (optimizer.pt: ") and warning.strip().endswith(
        f"resuming from {older} instead"
    )
    cut(older / "rng_state.pth")
    with pytest.raises(RecipeError, match=r"train\.resume_from=auto: every checkpoint in \S+ is damaged"):
        checkpoints.resume_path(train_cfg)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda m: shutil.rmtree(m) or m.mkdir(), r"no config\.json in the folder"),
        (lambda m: cut(m / "config.json"), r"damaged files \(config\.json: not a whole JSON"),
        (lambda m: cut(m / "model.safetensors"), r"damaged files \(model\.safetensors: cut short"),
        (lambda m: (m / "model.safetensors").unlink(), r"no weights in the folder"),
        (lambda m: shutil.rmtree(m), r"no such folder; check the path"),
    ],
    ids=["empty", "config cut", "weights cut", "no weights", "missing"],
)
def test_a_model_folder_with_a_missing_or_damaged_file_is_named(damage, message, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    save_file({"w": torch.zeros(64, 64)}, str(model / "model.safetensors"))
    check_folder(ModelConfig(name_or_path=str(model)), str(model))
    damage(model)
    with pytest.raises(RecipeError, match=rf"model\.name_or_path={model}: .*{message}"):
        check_folder(ModelConfig(name_or_path=str(model)), str(model))


# ---- resume through the command ----


@pytest.fixture(scope="module")
def run_with_checkpoints(tmp_path_factory) -> Path:
    from finetune.tools.train import main

    out = tmp_path_factory.mktemp("run") / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        assert main([*BASE, "train.save_steps=1", f"train.output_dir={out}"]) == 0
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(run, out)
    return out


@pytest.mark.parametrize(
    "name",
    ["trainer_state.json", "finetune_state.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt"],
)
def test_resuming_from_a_checkpoint_with_a_cut_file_names_it(name, run_with_checkpoints, tmp_path, capfd):
    out = copy_run(run_with_checkpoints, tmp_path)
    cut(out / "checkpoint-2" / name)
    before = snapshot(out)
    result = train_here(
        capfd, f"train.output_dir={out}", "train.max_steps=3", f"train.resume_from={out / 'checkpoint-2'}"
    )
    # each file against the size recorded at save time; the state file, written after the sizes, by its kind
    assert_one_error(
        result,
        rf"^error: train\.resume_from=\S+checkpoint-2 is damaged: {name}: ([\d,]+ bytes, "
        r"written as [\d,]+|not a whole JSON \(.*\)); resume from an earlier checkpoint-N",
    )
    assert snapshot(out) == before


def test_resume_auto_with_the_newest_checkpoint_cut_resumes_from_the_one_before(run_with_checkpoints, tmp_path, capfd):
    out = copy_run(run_with_checkpoints, tmp_path)
    cut(out / "checkpoint-2" / "optimizer.pt")
    result = train_here(capfd, f"train.output_dir={out}", "train.max_steps=3", "train.resume_from=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: {out / 'checkpoint-2'} is damaged (optimizer.pt: " in result.stderr
    assert f"resuming from {out / 'checkpoint-1'}" in result.stdout


def test_a_resume_that_changes_the_data_order_is_refused_unless_allowed(run_with_checkpoints, tmp_path, capfd):
    out = copy_run(run_with_checkpoints, tmp_path)
    before = snapshot(out)
    result = train_here(
        capfd, f"train.output_dir={out}", "train.max_steps=3", "train.resume_from=auto", "train.micro_batch_size=2"
    )
    assert_one_error(
        result,
        r"^error: train\.resume_from: resuming with micro_batches_per_step 2 → 4, "
        r"items_per_micro_batch 4 → 2 would train on another data order and position .*set "
        r"train\.global_batch_size \(or global_batch_tokens\), train\.micro_batch_size as that "
        r"run had them, or set train\.resume_data_order_change=allow",
    )
    assert snapshot(out) == before
    allowed = train_here(
        capfd,
        f"train.output_dir={out}",
        "train.max_steps=3",
        "train.resume_from=auto",
        "train.micro_batch_size=2",
        "train.resume_data_order_change=allow",
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]


def test_an_empty_or_damaged_model_folder_is_one_line(run_with_checkpoints, tmp_path, capfd):
    model = tmp_path / "model"
    shutil.copytree(run_with_checkpoints, model, ignore=shutil.ignore_patterns("checkpoint-*"))
    cut(model / "model.safetensors")
    recipe = tmp_path / "model.yaml"
    recipe.write_text(
        f"model:\n  name_or_path: {model}\ndata:\n  limit: 16\n  max_length: 64\n"
        "train:\n  micro_batch_size: 4\n  global_batch_size: 8\n  max_steps: 2\n"
        "log:\n  wandb_mode: disabled\n"
    )
    out = tmp_path / "out"
    result = train_here(capfd, f"recipe={recipe}", f"train.output_dir={out}")
    assert_one_error(
        result,
        rf"^error: model\.name_or_path={model}: damaged files \(model\.safetensors: cut short "
        r"\([\d,]+ of [\d,]+ bytes\)\); copy or download the model again$",
        out,
    )


def test_an_error_during_training_gets_a_line_of_its_own_after_the_progress_bar(tmp_path, capfd):
    out = tmp_path / "out"
    result = train_here(
        capfd,
        f"train.output_dir={out}",
        "train.on_nonfinite=stop",
        "optim.name=sgd",
        "optim.lr=1e30",
        "train.max_grad_norm=0",
        "train.max_steps=6",
    )
    assert_one_error(result, r"^error: optimizer step \d: .* not finite .*train\.on_nonfinite=stop", code=3)
    assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*"))  # nothing saved
    assert not [line for line in result.stderr.splitlines() if "error:" in line and not line.startswith("error:")]
