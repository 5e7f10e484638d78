"""scripts/gpu_check.py --smoke on a CPU: every step of the GPU check runs (at toy size) and the report holds what it
measured, each figure with the command that produced it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["verify_fp32", "verify_bf16", "verify_fp16", "benchmark_tiny", "gpu_tier", "loss_head", "host_syncs"]
STEPS += ["profile_packed"]
STEPS += ["sharded_fsdp2", "sharded_zero2", "sharded_zero3", "vlm_bf16", "vlm_qwen_bf16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow  # the GPU check's CPU smoke: every step of scripts/gpu_check.py, each a process of its own
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_smoke_runs_every_step_from_a_config_only_folder_and_writes_one_report(tmp_path):
    """The GPU machine's one command at toy size: gpu_carry.py's config + tokenizer folder (no weights) serves every
    step, the VLM's language model too (random weights written first)."""
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
    cmd = [sys.executable, "scripts/gpu_check.py", "--smoke", "--jobs", "2", "--model-folder", str(folder)]
    cmd += ["--out", str(out)]
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
    for name in ("verify_fp32", "verify_bf16", "host_syncs", "profile_packed"):
        assert f"model.name_or_path={folder} model.gguf_file=null" in steps[name]["command"], name
    assert f"--model-folder {folder}" in steps["benchmark_tiny"]["command"]
    for name in ("vlm_bf16", "vlm_qwen_bf16"):  # the VLM's language model, random init, each step's own
        random_lm = out / f"smollm2-random-{name}"
        assert f"model.name_or_path={random_lm} model.gguf_file=null" in steps[name]["command"]
        assert (random_lm / "model.safetensors").is_file()

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
    assert list(bench) == ["hf_padded", "hf_flatten", "token_budget", "packed", "trl_padding_free", "trl_packing"]
    for arm, r in bench.items():
        assert r["real_tokens_per_s"] > 0 and r["peak_mem_mb"] > 0 and r["mfu"] is None, arm  # no peak on a CPU
    best = bench["packed"]["best_hf_arm"]
    assert best in ("hf_padded", "hf_flatten") and bench[best]["tokens_per_s_vs_best_hf"] == 1.0
    best_trl = bench["packed"]["best_trl_arm"]
    assert best_trl in ("trl_padding_free", "trl_packing") and bench[best_trl]["tokens_per_s_vs_best_trl"] == 1.0

    syncs = steps["host_syncs"]["figures"]
    assert (
        syncs["steps"] == 2 and syncs["cuda_syncs_per_step"] is None
    )  # CPU: the syncs a CUDA run would make, modelled
    assert syncs["modelled_syncs_per_step"] > 0 and syncs["bound_per_step"] == 2 + 3
    assert sum(syncs["sync_sites_all_steps"].values()) > 0

    profile = steps["profile_packed"]["figures"]  # a CPU trace: its top-level ops stand in for kernels
    assert profile["kind"] == "cpu" and profile["micro_batches_per_step"] == 2 and len(profile["top"]) == 15
    assert profile["busy_us"] > 0 and 0 <= profile["idle"]["idle_us"] < profile["idle"]["span_us"]
    assert profile["host_syncs"]["counts"]["aten::_local_scalar_dense"] > 0
    assert "## Profile of one packed optimizer step" in md

    for config in ("fsdp2", "zero2", "zero3"):  # accelerate would run them unsharded on a CPU: each says so
        sharded = steps[f"sharded_{config}"]
        assert sharded["status"] == "skipped" and sharded["returncode"] == 2 and "needs a GPU" in sharded["reason"]
    for name, recipe in (("vlm_bf16", "vlm_seed"), ("vlm_qwen_bf16", "vlm_qwen")):
        vlm = steps[name]["figures"]
        for mode in ("padded", "token_budget", "packed"):
            assert vlm[mode]["samples_per_s"] > 0 and vlm[mode]["rows"] > 0, (name, mode)
        assert f"## VLM recipe recipes/{recipe}.yaml: training throughput" in md


def import_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
        from gpu_steps import Step
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gpu_check, Step


def test_a_step_the_budget_cannot_hold_is_not_started_and_one_over_its_box_is_stopped(tmp_path):
    gpu_check, Step = import_check()
    ran = tmp_path / "ran"
    step = Step("late", [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], 60, "json", str(ran))
    gpu_check.run_step(step, tmp_path, cuda=False, left=gpu_check.MIN_SECONDS - 1)
    assert not ran.exists()  # never started
    assert step.result["status"] == "not run" and "of the budget were left" in step.result["reason"]
    assert "not run" in (tmp_path / "late.log").read_text()

    slow = Step("slow", [sys.executable, "-c", "import time; time.sleep(60)"], 600, "json", str(ran))
    gpu_check.MIN_SECONDS, minimum = 1, gpu_check.MIN_SECONDS
    try:
        gpu_check.run_step(slow, tmp_path, cuda=False, left=2)  # 2 s left of the budget: less than its box
    finally:
        gpu_check.MIN_SECONDS = minimum
    assert slow.result["status"] == "failed" and slow.result["reason"].startswith("timed out after 2 s")
    assert slow.result["wall_s"] < 10

    first = tmp_path / "first"
    chained = Step(
        "chained",
        [sys.executable, "-c", f"open({str(ran)!r}, 'w')"],
        60,
        "json",
        str(ran),
        before=[sys.executable, "-c", f"open({str(first)!r}, 'w'); raise SystemExit(3)"],
    )
    gpu_check.run_step(chained, tmp_path, cuda=False, left=60)
    assert first.exists() and not ran.exists()  # the command it runs first failed: the step stops there
    assert chained.result["status"] == "failed" and chained.result["returncode"] == 3


def test_jobs_run_steps_side_by_side_and_record_each_as_it_ends(tmp_path):
    """With --jobs 2 the first step waits until the second has ended and been recorded: it ends only if both run at
    once and each is recorded as it ends (with one job, or records written at the end, it would time out)."""
    gpu_check, Step = import_check()
    signal = tmp_path / "second-recorded"
    wait = f"import pathlib, time\nwhile not pathlib.Path({str(signal)!r}).exists(): time.sleep(0.05)"
    steps = [
        Step("first", [sys.executable, "-c", wait], 60, "json", str(tmp_path / "none")),
        Step("second", [sys.executable, "-c", "pass"], 60, "json", str(tmp_path / "none")),
    ]
    ended = []

    def record(step):
        ended.append(step.name)
        signal.touch()

    gpu_check.run_steps(steps, tmp_path, False, time.perf_counter() + 60, 2, record)
    assert ended == ["second", "first"]  # recorded as each ends; the report orders them by the check
    assert [s.result["returncode"] for s in steps] == [0, 0]

    with pytest.raises(SystemExit) as refused:  # on a GPU the steps share the device: one at a time
        gpu_check.main(["--out", str(tmp_path / "report"), "--jobs", "2"])
    assert refused.value.code == 2 and not (tmp_path / "report").exists()


@pytest.mark.slow  # three of the GPU check's CPU smoke steps, each a process (sharded_fsdp2 on two ranks)
@pytest.mark.subprocess
def test_only_adds_its_steps_to_the_report_an_earlier_command_wrote(tmp_path):
    """Re-running the steps that failed: --only adds its steps to the report an earlier command wrote."""
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
