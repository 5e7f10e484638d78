"""Checkpoints are complete or absent, and a resumed run equals the uninterrupted one bitwise (CPU, fp32).

The uninterrupted reference saves a checkpoint every step; a resumed run starts from a copy of one of them (or from
what a killed or signalled run left) with train.resume_from=auto. Compared: the per-step logs (loss, grad norm, LR,
label tokens, epoch, skip counter) and every weight, with ==.
"""

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from finetune.recipe import RecipeError, TrainConfig, load_config
from finetune.training import checkpoints
from tests.forks import exit_code, forked, forked_signalled, resume_main, resume_rank
from tests.launch import ENV, ROOT, STOPPED_BY, assert_same_run, call, forked_ranks, step_logs

COMMON = [
    "recipe=recipes/debug.yaml",
    "data.limit=16",
    "data.max_length=64",
    "train.max_steps=4",
    "log.wandb_mode=disabled",
]
MODES = {
    "padded": [],
    "length_grouped": ["data.batching=length_grouped"],
    "token_budget": [
        "data.batching=token_budget",
        "data.max_tokens_per_micro_batch=128",
        "train.global_batch_tokens=256",
    ],
    "packed": ["data.batching=packed"],
    "padded+lora": ["model.lora.enabled=true", "optim.lr=1e-2"],  # adapter_model.safetensors, PEFT's own loading
    # bitsandbytes' 8-bit states (blockwise-quantized, their absmax and code maps) on the embedding and the MLPs
    "adamw_8bit": ["optim.name=adamw_8bit"],
    # a 4-bit base with LoRA of rank 64 (lora_B of gate/up: 128 × 64, big enough for 8-bit states), paged states
    "qlora+paged_adamw_8bit": [
        "model.quantization.bits=4",
        "model.lora.enabled=true",
        "model.lora.r=64",
        "model.lora.target_modules=all-linear",
        "optim.name=paged_adamw_8bit",
        "optim.lr=1e-2",
    ],
}


_references: dict[str, Path] = {}


@pytest.fixture(autouse=True)
def resumed_runs_thread_count(monkeypatch):
    """Every in-process run here uses the thread count of the subprocess runs (ENV): a reduction split over 2 threads
    can differ bitwise from 1, and these tests compare runs bit for bit. train() sets its threads from
    OMP_NUM_THREADS (finetune/tools/train.py use_cpu_threads), so that is set as the subprocesses have it."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", ENV["OMP_NUM_THREADS"])
    torch.set_num_threads(int(ENV["OMP_NUM_THREADS"]))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of a batching mode (trained in this process once), saving a checkpoint every step."""

    def get(mode: str) -> Path:
        if mode not in _references:
            from finetune.tools.train import train

            out = tmp_path_factory.mktemp(f"reference-{mode}")
            # as many CPU threads as the resumed runs (ENV): a reduction split over 2 threads can differ bitwise from 1
            threads = torch.get_num_threads()
            torch.set_num_threads(int(ENV["OMP_NUM_THREADS"]))
            try:
                assert train(load_config([*COMMON, *MODES[mode], "train.save_steps=1", f"train.output_dir={out}"])) == 0
            finally:
                torch.set_num_threads(threads)
            _references[mode] = out
        return _references[mode]

    return get


@pytest.mark.e2e
def test_checkpoint_files_are_complete_safetensors_and_weights_only_loadable(reference):
    out = reference("padded")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        f"checkpoint-{k}" for k in (1, 2, 3, 4)
    ]
    assert not (out / checkpoints.STAGING).exists()
    folder = out / "checkpoint-2"
    names = {p.name for p in folder.iterdir()}
    assert {
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
        checkpoints.STATE_FILE,
    } <= names
    assert not {"pytorch_model.bin", "model.bin"} & names  # weights only as safetensors
    for state_file in folder.glob("*.p*"):  # optimizer.pt, scheduler.pt, rng_state.pth: no pickled objects
        torch.load(state_file, weights_only=True)
    rng = torch.load(folder / "rng_state.pth", weights_only=True)
    assert {"python", "numpy", "cpu"} <= rng.keys()
    before = np.random.get_state()
    checkpoints.set_rng_state(rng)
    kind, keys, pos, *_ = np.random.get_state()
    assert (kind, int(pos)) == (rng["numpy"]["kind"], rng["numpy"]["pos"])
    assert np.array_equal(keys, rng["numpy"]["keys"].numpy().astype(np.uint32))
    np.random.set_state(before)
    state = json.loads((folder / checkpoints.STATE_FILE).read_text())
    assert re.fullmatch(r"[0-9a-f]{16}", state["data_position"].pop("data_fingerprint"))
    assert state == {
        "nonfinite_skipped": 0,
        "data_position": {
            "dataset_items": 16,
            "seed": 0,
            "ranks": 1,
            "micro_batches_per_step": 2,
            "items_per_micro_batch": 4,
        },
    }


@pytest.mark.e2e
@pytest.mark.parametrize(
    "mode, start",
    [
        ("padded", 2),  # 2: the epoch's end
        ("length_grouped", 3),
        ("token_budget", 1),
        ("packed", 3),
        ("padded+lora", 3),
        ("adamw_8bit", 1),
        ("qlora+paged_adamw_8bit", 2),
    ],
)
def test_resume_equals_the_uninterrupted_run_bitwise(mode, start, reference, tmp_path):
    from finetune.tools.train import train

    ref = reference(mode)
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(ref / f"checkpoint-{start}", out / f"checkpoint-{start}")
    argv = [
        *COMMON,
        *MODES[mode],
        "train.save_steps=1",
        "train.save_total_limit=2",
        f"train.output_dir={out}",
        "train.resume_from=auto",
    ]
    assert train(load_config(argv)) == 0
    assert_same_run(out, ref)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]  # rotated in place


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["adamw_8bit", "qlora+paged_adamw_8bit"])
def test_bitsandbytes_checkpoints_hold_8bit_optimizer_states(mode, reference):
    """What the bitwise resume above restores is 8-bit: uint8 states with their blockwise absmax, loadable without
    pickle; the adapter's weights only (the 4-bit base is not saved into a checkpoint)."""
    folder = reference(mode) / "checkpoint-2"
    state = torch.load(folder / "optimizer.pt", weights_only=True)["state"]
    packed = [s["__bnb_optimizer_quant_state__"] for s in state.values()]
    assert any(s["state1"].dtype == torch.uint8 and s["absmax1"].dtype == torch.float32 for s in packed)
    if mode.startswith("qlora"):
        assert (folder / "adapter_model.safetensors").is_file() and not (folder / "model.safetensors").exists()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "change, named",
    [
        ("model.quantization.bits=none", "model.quantization.bits=4, this run has model.quantization.bits=none"),
        ("model.quantization.bnb_4bit_quant_type=fp4", "bnb_4bit_quant_type=nf4, this run has model.quantization"),
    ],
)
def test_resuming_a_4bit_checkpoint_with_another_quantization_is_one_error(change, named, reference, tmp_path):
    """The adapter trained over one rounding of the base: resumed over another (full precision, FP4) it would train
    on as if nothing changed. The checkpoint's recipe.yaml names the quantization; the resume is refused."""
    from finetune.tools.train import train

    mode = "qlora+paged_adamw_8bit"
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(reference(mode) / "checkpoint-2", out / "checkpoint-2")
    argv = [*COMMON, *MODES[mode], change, f"train.output_dir={out}", "train.resume_from=auto"]
    with pytest.raises(
        RecipeError, match=r"^train\.resume_from: \S+checkpoint-2 was trained with model\.quantization\."
    ) as e:
        train(load_config(argv))
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.e2e
def test_resuming_from_the_last_step_mid_epoch_trains_nothing_more(reference, tmp_path):
    from finetune.tools.train import train

    ref = reference("padded")  # 2 optimizer steps per epoch: with train.max_steps=3, checkpoint-3 is mid-epoch
    shutil.copytree(ref / "checkpoint-3", tmp_path / "checkpoint-3")
    argv = [*COMMON, "train.max_steps=3", f"train.output_dir={tmp_path}", "train.resume_from=auto"]
    assert train(load_config(argv)) == 0
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]  # no checkpoint-4
    assert step_logs(tmp_path) == step_logs(ref)[:3]
    got, want = load_file(tmp_path / "model.safetensors"), load_file(ref / "checkpoint-3" / "model.safetensors")
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.e2e
def test_resuming_with_other_data_or_ranks_is_an_error_unless_allowed_then_warns(reference, tmp_path, monkeypatch):
    from finetune.assemble import build
    from finetune.training import recipe_trainer as trainer_module

    state = checkpoints.read_state(str(reference("padded") / "checkpoint-2"))
    warnings = []
    monkeypatch.setattr(trainer_module.logger, "warning", warnings.append)
    same = build(load_config([*COMMON, f"train.output_dir={tmp_path}"]))
    same.restore_checkpoint_state(state)
    assert warnings == []
    other = build(load_config([*COMMON, "data.limit=12", f"train.output_dir={tmp_path}"]))
    with pytest.raises(
        RecipeError,
        match=r"resuming with dataset_items 16 → 12 would train on another data order .* "
        r"set data\.source/data\.limit as that run had them, or set "
        r"train\.resume_data_order_change=allow",
    ):
        other.restore_checkpoint_state(state)
    assert warnings == []
    allowed = build(
        load_config([*COMMON, "data.limit=12", "train.resume_data_order_change=allow", f"train.output_dir={tmp_path}"])
    )
    allowed.restore_checkpoint_state(state)
    assert len(warnings) == 1 and warnings[0].startswith("resuming with dataset_items 16 → 12: the data order")


def killed_args(out: Path) -> list[str]:
    return [*COMMON, "train.save_steps=1", f"train.output_dir={out}", "train.resume_from=auto"]


@pytest.mark.e2e
@pytest.mark.subprocess
def test_kill_9_mid_window_then_mid_save_resumes_bitwise(reference, tmp_path, capfd):
    out = tmp_path / "killed"
    # tests/workers/resume_worker.py's kills, each in a process forked from this one: SIGKILL ends that process only
    first = forked(capfd, resume_main, "window:2", killed_args(out))  # inside step 2's window: checkpoint-1 the newest
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    second = forked(capfd, resume_main, "save:3", killed_args(out))  # SIGKILL while checkpoint-3 is being written
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-1'}" in second.stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert (out / checkpoints.STAGING / "checkpoint-3" / "model.safetensors").is_file()  # half-written, not resumed
    third = call(capfd, killed_args(out))  # the resume that finishes: in this process
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-2'}" in third.stdout
    assert not (out / checkpoints.STAGING).exists()
    assert_same_run(out, reference("padded"))


@pytest.mark.e2e
@pytest.mark.subprocess
def test_sigterm_and_sigint_finish_the_step_save_and_print_the_resume_command(reference, tmp_path, capfd):
    out = tmp_path / "signalled"
    argv = [*COMMON, f"train.output_dir={out}"]  # no train.save_steps: only the signal makes a checkpoint
    # `python finetune/train.py ARGV` in a process forked from this one, signalled as a fresh one would be
    code, stdout, _ = forked_signalled(argv, signal.SIGTERM, "step 1/4")
    assert code == STOPPED_BY[signal.SIGTERM], stdout[-3000:]  # 143: "stopped, resume me", as a shell reports it
    stopped = re.search(r"stopped by SIGTERM after optimizer step (\d) of 4; checkpoint: (\S+)", stdout)
    assert stopped, stdout[-3000:]
    assert Path(stopped.group(2)) == out / f"checkpoint-{stopped.group(1)}" and Path(stopped.group(2)).is_dir()
    assert not (out / "model.safetensors").exists()  # not the end of training: no final model
    command = re.search(r"^resume with: (.+)$", stdout, re.M).group(1)
    assert shlex.split(command) == [sys.executable, "finetune/train.py", *argv, "train.resume_from=auto"]

    resume_args = shlex.split(command)[2:]  # after the interpreter and the script, as asserted above
    code, stdout, _ = forked_signalled(resume_args, signal.SIGINT, "resuming from")  # during start-up
    assert code == STOPPED_BY[signal.SIGINT] and "stopped by SIGINT" in stdout, stdout[-3000:]  # 130
    finished = call(capfd, resume_args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_same_run(out, reference("padded"))


@pytest.mark.slow  # the soak script: its reference and every run it kills a fresh interpreter of its own
@pytest.mark.subprocess
def test_soak_quick_resumes_every_kill_identically():
    result = subprocess.run(
        [sys.executable, "scripts/soak_resume.py", "--quick", "--seed", "1"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2/2 kills resumed identically" in result.stdout


def complete(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    (folder / checkpoints.STATE_FILE).write_text("{}")
    return folder


def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    train = TrainConfig(output_dir=str(tmp_path), resume_from="auto")
    assert checkpoints.resume_path(train) is None  # nothing there: a fresh start
    complete(tmp_path / "checkpoint-2")
    newest = complete(tmp_path / "checkpoint-10")
    (tmp_path / "checkpoint-12").mkdir()  # a folder without its state files (not written by commit)
    complete(tmp_path / checkpoints.STAGING / "checkpoint-14")  # written, never renamed into place
    complete(tmp_path / "checkpoint-x")
    assert checkpoints.resume_path(train) == str(newest)
    train.resume_from = str(tmp_path / "checkpoint-12")
    with pytest.raises(RecipeError, match="checkpoint-12: not a complete checkpoint"):
        checkpoints.resume_path(train)
    train.resume_from = str(tmp_path / "nowhere")
    with pytest.raises(RecipeError, match="no such checkpoint folder"):
        checkpoints.resume_path(train)


def test_commit_replaces_an_existing_checkpoint_whole(tmp_path):
    old = complete(tmp_path / "checkpoint-3")
    (old / "stale.txt").write_text("old")
    staged = complete(tmp_path / checkpoints.STAGING / "checkpoint-3")
    (staged / "model.safetensors").write_bytes(b"new")
    checkpoints.commit(str(staged), str(old))
    assert not staged.exists() and not (old / "stale.txt").exists()
    assert (old / "model.safetensors").read_bytes() == b"new"


def test_the_package_loads_no_pickle_and_trusts_no_remote_code_unless_the_recipe_says_so():
    """Every torch.load in finetune/ passes weights_only=True; no pickle, no unsafe YAML; trust_remote_code comes from
    the recipe (default False), never a literal True."""
    import ast

    from finetune.recipe import ModelConfig

    assert ModelConfig().trust_remote_code is False
    problems = []
    for source in sorted((ROOT / "finetune").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                problems += [f"{source.name}: imports pickle" for n in names if n.split(".")[0] in ("pickle", "dill")]
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if name.endswith("torch.load") and not (
                isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is True
            ):
                problems.append(f"{source.name}:{node.lineno}: torch.load without weights_only=True")
            if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                problems.append(f"{source.name}:{node.lineno}: {name}")
            remote = keywords.get("trust_remote_code")
            if isinstance(remote, ast.Constant) and remote.value is True:
                problems.append(f"{source.name}:{node.lineno}: trust_remote_code=True")
    assert problems == []


# ---- a stop mid-window: none of the window applied, the resume runs it again (finetune/training/window_stop.py) ----

# Four micro-batches of one row per window and rank, two windows per epoch; attention dropout, so the resume equals the
# uninterrupted run only with the generators as they were at the window's start (or the epoch's, for its first window)
MID_WINDOW = [
    "recipe=recipes/debug.yaml",
    "data.max_length=64",
    "train.max_steps=4",
    "train.micro_batch_size=1",
    "log.wandb_mode=disabled",
    "model.config_overrides.attention_dropout=0.1",
]
RANKS = {1: ["data.limit=8", "train.global_batch_size=4"], 2: ["data.limit=16", "train.global_batch_size=8"]}
_mid_window_references: dict[int, Path] = {}


def launched(capfd, ranks: int, kill_at: str, args: list[str]) -> subprocess.CompletedProcess:
    """tests/workers/resume_worker.py KILL_AT ARGS in one process, or on two CPU (gloo) ranks, forked from this one (a
    rank that fails fails the test); its exit code and output."""
    if ranks == 1:
        return forked(capfd, resume_main, kill_at, args, ACCELERATE_USE_CPU="true")
    capfd.readouterr()
    forked_ranks(resume_rank, kill_at, args, ACCELERATE_USE_CPU="true")  # each rank asserts its exit code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["resume_worker", kill_at, *args], exit_code(kill_at), out, err)


def mid_window_reference(capfd, ranks: int, tmp_path_factory) -> Path:
    if ranks not in _mid_window_references:
        out = tmp_path_factory.mktemp(f"mid-window-reference-{ranks}")
        done = launched(capfd, ranks, "none", [*MID_WINDOW, *RANKS[ranks], f"train.output_dir={out}"])
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        _mid_window_references[ranks] = out
    return _mid_window_references[ranks]


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.parametrize(
    "ranks, step",
    [
        (1, 2),  # the epoch's second window
        (1, 3),  # the first window of the second epoch: a resume restores the generators before the epoch's iterator
        pytest.param(2, 2, marks=pytest.mark.distributed),  # rank 0 alone is signalled: the ranks agree
    ],
)
def test_sigterm_mid_window_applies_none_of_it_and_the_resume_equals_the_uninterrupted_run_bitwise(
    ranks, step, tmp_path_factory, tmp_path, capfd
):
    reference = mid_window_reference(capfd, ranks, tmp_path_factory)
    out = tmp_path / "stopped"
    args = [*MID_WINDOW, *RANKS[ranks], f"train.output_dir={out}", "train.resume_from=auto"]
    stopped = launched(capfd, ranks, f"term:{step}", args)
    assert stopped.returncode == STOPPED_BY[signal.SIGTERM], stopped.stdout[-2000:] + stopped.stderr[-3000:]
    cut = re.search(rf"optimizer step {step} stopped after (\d) of its 4 micro-batches", stopped.stdout)
    assert cut and 1 <= int(cut.group(1)) <= 3, stopped.stdout[-3000:]  # mid-window, not at its end
    assert f"stopped by SIGTERM after optimizer step {step - 1} of 4" in stopped.stdout, stopped.stdout[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{step - 1}"]
    assert checkpoints.checkpoint_step(str(out / f"checkpoint-{step - 1}")) == step - 1
    assert not (out / "model.safetensors").exists()
    resumed = launched(capfd, ranks, "none", args)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{step - 1}'}" in resumed.stdout
    assert_same_run(out, reference)


@pytest.mark.slow  # two optimizer steps of 128 micro-batches, trained twice (the reference, the stop and its resume)
@pytest.mark.e2e
@pytest.mark.subprocess
def test_sigterm_in_a_window_of_128_micro_batches_saves_and_exits_within_20_s_and_resumes_bitwise(tmp_path, capfd):
    """The issue's bound: a container's grace period (30 s on Kubernetes) is shorter than a window of 128
    micro-batches; the stop comes at the next micro-batch."""
    args = [
        "recipe=recipes/debug.yaml",
        "data.limit=256",
        "data.max_length=64",
        "train.micro_batch_size=1",
        "train.global_batch_size=128",
        "train.max_steps=2",
        "log.wandb_mode=disabled",
    ]
    reference, out = tmp_path / "reference", tmp_path / "stopped"
    done = call(capfd, [*args, f"train.output_dir={reference}"])  # the uninterrupted run: in this process
    assert done.returncode == 0, done.stderr[-3000:]
    stopped_args = [*args, f"train.output_dir={out}", "train.resume_from=auto"]
    # a process forked from this one, sent SIGTERM 1 s after "step 1/2" (into the second window); its exit awaited
    code, stdout, sent = forked_signalled(stopped_args, signal.SIGTERM, "step 1/2", delay=1.0)
    took = time.monotonic() - sent if sent is not None else None
    assert code == STOPPED_BY[signal.SIGTERM] and took is not None, stdout[-3000:]
    cut = re.search(r"optimizer step 2 stopped after (\d+) of its 128 micro-batches", stdout)
    assert cut and 1 <= int(cut.group(1)) < 127, stdout[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert took < 20, f"{took:.1f} s from SIGTERM to exit"
    resumed = call(capfd, stopped_args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(out, reference)
