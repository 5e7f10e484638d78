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


@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_smoke_runs_every_step_and_writes_one_report(tmp_path):
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
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
