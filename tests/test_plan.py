"""finetune.plan: the largest micro-batch that fits, global batch kept; measured on CPU with real training steps."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from finetune.recipe import RecipeError, load_config
from finetune.tools import memory_trials
from finetune.tools import plan as planner
from tests.launch import call

ROOT = Path(__file__).resolve().parents[1]
DEBUG = "recipe=recipes/debug.yaml"
GIB = 2**30


def run(cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def debug32():
    cfg = load_config([DEBUG, "train.global_batch_size=32"])
    return cfg, memory_trials.Trials(cfg, 1)


# recipes/qlora.yaml at the size of its golden run (tests/golden/qlora.json): the tiny Llama in 4-bit NF4 with LoRA
QLORA = [
    "recipe=recipes/qlora.yaml",
    *(o for o in json.loads((ROOT / "tests/golden/qlora.json").read_text())["overrides"] if o.startswith("model.")),
    "data.limit=160",
]


def plan_in_own_process(recipe: list[str]) -> dict:
    """The plan at global batch 32 given just less memory than a step at micro-batch 32 takes, in a fresh process
    (tests/workers/plan_worker.py), with the measured high-water mark of a step at the chosen micro-batch."""
    done = run([sys.executable, "tests/workers/plan_worker.py", *recipe])
    line = next((x for x in done.stdout.splitlines() if x.startswith("PLAN ")), None)
    assert done.returncode == 0 and line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("PLAN ") :])


@pytest.mark.e2e  # builds the recipe's trainer and runs real training steps
@pytest.mark.subprocess  # a fresh process as finetune-plan runs: the plan reads its RSS (tests/workers/plan_worker.py)
@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param([DEBUG], id="debug"),
        # slow: a fresh process planning the 4-bit model with real training steps, over the default tier's budget
        pytest.param(QLORA, id="qlora", marks=pytest.mark.slow),
    ],
)
def test_the_choice_fits_keeps_the_global_batch_and_its_peak_is_predicted_within_10_percent(recipe):
    # Just less memory than a step at micro-batch 32 takes: the plan must pick a smaller micro-batch that fits.
    r = plan_in_own_process(recipe)
    assert 1 < r["value"] < 32
    assert r["value"] * r["accumulation"] == 32 and r["global_batch"] == 32 and 32 % r["value"] == 0
    assert r["peak_bytes"] <= r["limit_bytes"] == pytest.approx(0.9 * r["memory"])
    assert r["lr"] == r["config_lr"] and f"set: train.micro_batch_size={r['value']}" in r["describe"]
    # Really fits: a worst-case training step at the chosen micro-batch stays within the memory.
    assert r["chosen_step_high_water_mark"] <= r["memory"]
    # The predicted peak is the measured one within 10 % (4-bit weights and 8-bit optimizer states included)
    measured = r["chosen_step_high_water_mark"]
    assert abs(r["peak_bytes"] - measured) <= 0.10 * measured, (r["peak_bytes"], measured)


@pytest.mark.e2e  # builds the debug recipe's trainer and runs real training steps
def test_token_budget_plans_the_budget():
    cfg = load_config(
        [DEBUG, "data.batching=token_budget", "data.max_tokens_per_micro_batch=128", "train.global_batch_tokens=512"]
    )
    result = planner.plan(cfg, 1)
    assert result.key == "data.max_tokens_per_micro_batch" and result.unit == "tokens"
    assert (result.value, result.accumulation) == (512, 1)  # a tiny model: the whole budget fits anywhere
    assert sorted(result.measured) == [128, 256, 512]  # each measured by a real step, none extrapolated


def test_candidates_and_search():
    assert planner.divisors(12) == [1, 2, 3, 4, 6, 12]
    cfg = load_config([DEBUG, "train.global_batch_size=24"])
    assert planner.candidates(cfg, 2) == ("train.micro_batch_size", "sequences", 24, [1, 2, 3, 4, 6, 12])
    with pytest.raises(RecipeError, match="train.global_batch_size=24 is not divisible by 5 ranks"):
        planner.candidates(cfg, 5)
    budget = load_config(
        [DEBUG, "data.batching=packed", "data.max_tokens_per_micro_batch=128", "train.global_batch_tokens=768"]
    )
    assert planner.candidates(budget, 1)[3] == [128, 192, 256, 384, 768]  # ≥ data.max_length (128)

    tried = []

    def fits(v):
        tried.append(v)
        return v <= 6

    values = [1, 2, 3, 4, 6, 12, 24]
    assert values[planner.largest_fitting(values, fits)] == 6 and len(tried) <= 4
    assert planner.largest_fitting(values, lambda v: False) is None
    assert memory_trials.fit_line({100: 1000.0, 200: 1500.0, 400: 2500.0}) == pytest.approx((500.0, 5.0))


class GpuLikeTrials:
    """The GPU branch without a GPU: out of memory above 12 sequences, 1 GiB + 0.1 GiB per sequence below."""

    on_gpu, oom, gradient_bytes, device = True, torch.OutOfMemoryError, 0, "cuda:0"
    longest = {"input_ids": [0] * 100}
    trainer = None  # no built trainer: no eval set to measure

    def __init__(self):
        self.tried = []

    def tokens(self, value):
        return 100 * value

    def peak(self, value):
        self.tried.append(value)
        if value > 12:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 0.5 * GIB, (1 + 0.1 * value) * GIB


def test_gpu_search_treats_out_of_memory_as_not_fitting():
    cfg = load_config([DEBUG, "train.global_batch_size=48"])
    trials = GpuLikeTrials()
    result = planner.plan(cfg, 1, headroom=0.1, memory_gib=100, trials=trials)
    assert (result.value, result.accumulation) == (12, 4)  # 16, 24 and 48 ran out of memory
    assert result.peak_bytes == pytest.approx(2.2 * GIB) and result.measured[16] == float("inf")
    assert len(trials.tried) <= 5  # a binary search over 10 candidates, not one trial each
    # no out-of-memory but over the limit does not fit either: 1 + 0.1 × 8 = 1.8 GiB > 0.9 × 1.9 GiB ≥ 1.6 GiB
    assert planner.plan(cfg, 1, headroom=0.1, memory_gib=1.9, trials=GpuLikeTrials()).value == 6


@pytest.mark.e2e
def test_auto_micro_batch_in_training(tmp_path, capfd):
    out = tmp_path / "auto"
    result = call(
        capfd,
        [
            DEBUG,
            "train.micro_batch_size=auto",
            "train.global_batch_size=16",
            "train.max_steps=1",
            f"train.output_dir={out}",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = int(re.search(r"train.micro_batch_size=auto → (\d+)", result.stdout).group(1))
    startup = r"effective batch 16 sequences = micro (\d+) × accumulation (\d+) × 1 rank"
    micro, accumulation = map(int, re.search(startup, result.stdout).groups())
    assert micro == chosen and micro * accumulation == 16
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["micro_batch_size"] == chosen


def test_recipe_errors(capfd):
    for args in (["recipe=recipes/missing.yaml"], [DEBUG, "optim.lrr=1e-4"]):
        trained = call(capfd, args)
        planned = call(capfd, args, tool="finetune.plan")
        assert trained.returncode == planned.returncode == 2
        assert planned.stderr.startswith("error: ") and planned.stderr == trained.stderr
    nothing = call(capfd, [DEBUG, "plan.memory_gib=0.1"], tool="finetune.plan")
    assert nothing.returncode == 2 and nothing.stderr.splitlines()[-1].startswith("error: nothing fits")
    with pytest.raises(RecipeError, match="must be a positive integer or auto"):
        load_config([DEBUG, "train.micro_batch_size=eight"])
    with pytest.raises(RecipeError, match="train.micro_batch_size=auto plans sequences per micro-batch"):
        load_config(
            [
                DEBUG,
                "train.micro_batch_size=auto",
                "data.batching=token_budget",
                "data.max_tokens_per_micro_batch=128",
                "train.global_batch_tokens=1024",
            ]
        )
    with pytest.raises(RecipeError, match="unknown key 'plan.headrom'"):
        planner.split_args([DEBUG, "plan.headrom=0.2"])
