"""scripts/sharded_check.py on the CPU: single_gpu.yaml (the engines it checks on a GPU, FSDP2 and ZeRO, say they need
one here) trains, resumes bitwise on the same curve, consolidates to a model from_pretrained loads, and keeps the best
model; and each check fails on a run that broke what it checks."""

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import set_seed

from finetune.model import loading
from finetune.recipe import load_config
from tests.launch import environ_kept

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sharded_check", ROOT / "scripts" / "sharded_check.py")
sharded_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sharded_check)

# lr 0.1 on the debug model: the eval loss goes down, up, down, up (10.51, 13.45, 10.40, 11.12 after steps 1-4), so the
# best model is neither the first nor the last evaluation
ARGS = ["--steps", "4", "--save-steps", "2", "--resume-step", "2", "eval.every_steps=1", "optim.lr=0.1"]


def check(config: str, out: Path, *extra: str) -> tuple[int, str]:
    """scripts/sharded_check.py's main in this process, from the repository root: (exit code, what it printed)."""
    argv = ["--config", f"accelerate_configs/{config}.yaml", "--json", str(out), *extra]
    printed, cwd = io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(printed):
            code = sharded_check.main(argv)
    finally:
        os.chdir(cwd)
    return code, printed.getvalue()


def launched_here(config: Path, args: list[str], log: Path) -> tuple[int, float, str]:
    """sharded_check.launch's twin: the training command in this process, as `accelerate launch` runs it with
    single_gpu.yaml on the CPU (one plain process), its stdout and stderr (the file descriptors too) in `log`."""
    from finetune.tools import train

    assert sharded_check.engine_of(config) == "none"  # a sharding engine is only real under its launcher
    start = time.perf_counter()
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    with log.open("w") as out, environ_kept("ACCELERATE_USE_CPU", "WANDB_MODE"):
        for fd in (1, 2):
            os.dup2(out.fileno(), fd)
        os.environ.update(ACCELERATE_USE_CPU="true", WANDB_MODE="disabled")  # what launch gives its runs on the CPU
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = train.main(list(args))
        finally:
            out.flush()
            for fd, saved in zip((1, 2), saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
    return code, time.perf_counter() - start, log.read_text()


def checked_single_gpu(tmp: Path) -> tuple[dict, Path, str]:
    """The check of single_gpu.yaml on the CPU, with ARGS: (its JSON report, its work folder, what it printed)."""
    code, stdout = check("single_gpu", tmp / "out.json", "--work", str(tmp / "work"), *ARGS)
    report = json.loads((tmp / "out.json").read_text())
    assert code == 0, stdout[-3000:] + json.dumps(report)[-3000:]
    return report, tmp / "work", stdout


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """The check with its runs A and B in this process (the launcher's own test is the slow one below)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sharded_check, "launch", launched_here)
        return checked_single_gpu(tmp_path_factory.mktemp("sharded"))


def logged(folder: Path) -> tuple[dict, dict]:
    """({step: training loss}, {step: eval loss}) read straight from the run's trainer_state.json."""
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    steps = {e["step"]: e["loss"] for e in history if "loss" in e and "grad_norm" in e}
    return steps, {e["step"]: e["eval_loss"] for e in history if "eval_loss" in e}


def test_single_gpu_on_the_cpu_passes_every_check(checked):
    assert_every_check_passed(*checked)


@pytest.mark.slow  # slow: the script as users run it, runs A and B two `accelerate launch` processes (30 s of CPU)
@pytest.mark.subprocess
def test_the_script_launches_its_runs_through_accelerate_launch(tmp_path):
    assert_every_check_passed(*checked_single_gpu(tmp_path))


def assert_every_check_passed(report: dict, work: Path, stdout: str) -> None:
    assert stdout.splitlines()[-1].startswith("PASS sharded_check single_gpu fp32")
    assert report["passed"] and report["failed"] == [] and report["precision"] == "fp32" and report["device"] == "cpu"
    assert report["eval_steps"] == 1 and report["steps"] == 4 and report["resume_step"] == 2
    a_steps, a_evals = logged(work / "a")
    b_steps, _ = logged(work / "b")
    resume = report["resume"]
    assert resume["resumed_from"] == str(work / "a" / "checkpoint-2") and resume["compared_steps"] == [3, 4]
    assert resume["max_rel_diff"] == 0.0 and resume["tolerance"] == 0.0  # fp32 on the CPU: bitwise
    assert [b_steps[s] for s in (3, 4)] == [a_steps[s] for s in (3, 4)] == resume["losses_a"]
    consolidated = report["consolidated"]
    assert consolidated["missing_keys"] == consolidated["unexpected_keys"] == consolidated["mismatched_keys"] == 0
    assert consolidated["weight_files"] == ["model.safetensors"] and consolidated["safetensors_only"]
    assert consolidated["parameters"] > 0 and consolidated["equals_last_checkpoint"] is True
    assert consolidated["eval_loss"] == pytest.approx(a_evals[4], rel=1e-6)
    assert consolidated["trained_rel_change"] == pytest.approx(abs(a_evals[4] - a_evals[0]) / a_evals[4], rel=1e-9)
    best_step = min((s for s in a_evals if s > 0), key=lambda s: a_evals[s])
    assert best_step not in (1, 4), "the run must make the best model neither the first nor the last"
    best = report["best"]
    assert best["step"] == best_step and best["eval_loss"] == a_evals[best_step]
    assert best["loaded_eval_loss"] == pytest.approx(a_evals[best_step], rel=1e-6) and best["missing_keys"] == 0
    assert report["wall_s"]["run_a"] > 0 and report["wall_s"]["run_b"] > 0


def test_the_gpu_report_row_holds_the_checks_figures(checked):
    """scripts/gpu_check.py's report renders this JSON (on a GPU: fsdp2, zero2, zero3) as one table row."""
    report, _, _ = checked
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
    gpu_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_report)
    step = {"name": "sharded_single_gpu", "status": "passed", "reason": None, "figures": report}
    row = gpu_report._sharded([step])[4]
    whole, best = report["consolidated"], report["best"]
    assert row.startswith("| single_gpu | passed | fp32 | 0.0e+00 (0) | ")
    assert f"{whole['parameters']:,}, 0/0" in row
    assert f"{whole['eval_loss']:.4f} vs {whole['logged_eval_loss']:.4f}" in row
    assert f"| {best['step']} ({best['expected_step']}) |" in row


def test_resume_check_fails_when_one_loss_moves_or_b_did_not_resume(checked, tmp_path):
    _, work, _ = checked
    output = (work / "b.log").read_text()
    assert sharded_check.check_resume(work / "a", work / "b", output, 2, 0.0)["pass"]
    state = json.loads((work / "b" / "trainer_state.json").read_text())
    entry = next(e for e in state["log_history"] if e.get("step") == 4 and "grad_norm" in e)
    entry["loss"] = float(torch.nextafter(torch.tensor(entry["loss"]), torch.tensor(0.0)))  # one float32 step lower
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    moved = sharded_check.check_resume(work / "a", tmp_path, output, 2, 0.0)
    assert not moved["pass"] and 0 < moved["max_rel_diff"] < 1e-6
    fresh = output.replace("resuming from", "starting at")  # B trained from the start: the same curve, not a resume
    assert not sharded_check.check_resume(work / "a", work / "b", fresh, 2, 0.0)["pass"]


def test_consolidated_and_best_checks_fail_on_the_wrong_weights_or_step(checked, tmp_path):
    report, work, _ = checked
    a = tmp_path / "a"
    shutil.copytree(work / "a", a)
    args = report["recipe_args"]
    evaluator = sharded_check.Evaluator(args, a, tmp_path / "eval")
    cfg = load_config(args)
    set_seed(cfg.train.seed)  # the run's initial weights, as finetune.assemble.load_model makes them
    init = loading.load_model(cfg.model, loading.model_folder(cfg.model)).state_dict()
    tied = {k: v.contiguous() for k, v in init.items() if k != "lm_head.weight"}  # tied to the embedding
    save_file(tied, str(a / "model.safetensors"), metadata={"format": "pt"})  # the final save wrote the init
    wrong = sharded_check.check_consolidated(a, evaluator, 1e-5)
    assert wrong["missing_keys"] == 0 and wrong["equals_last_checkpoint"] is False
    assert not wrong["pass"] and wrong["eval_loss"] == pytest.approx(logged(a)[1][0], rel=1e-6)  # the step-0 loss
    best = json.loads((a / "best" / "best.json").read_text())
    (a / "best" / "best.json").write_text(json.dumps({**best, "step": 4}))  # the last evaluation, not the lowest
    assert not sharded_check.check_best(a, evaluator, 1e-5)["pass"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these configs run")
@pytest.mark.parametrize("config", ["fsdp2", "zero2"])
def test_sharded_configs_say_they_need_a_gpu(tmp_path, config):
    code, stdout = check(config, tmp_path / "out.json", "--work", str(tmp_path / "work"))
    assert code == 2 and "needs a GPU" in stdout
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["passed"] is None and report["skipped"].startswith(("fsdp needs", "deepspeed needs"))
    assert not (tmp_path / "work").exists()  # nothing was launched
