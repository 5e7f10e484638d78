"""Schedules against torch's OneCycleLR and independent formulas at every optimizer step, in-process and through
`finetune/train.py`'s main (with accumulation, and on two forked CPU ranks); LR scaling; the start-up line; bad
input."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from finetune.recipe import RecipeError, ScheduleConfig, load_config, resolve_plan
from finetune.recipe.run_plan import peak_lr, scaled_lr
from finetune.tools import train
from finetune.training.schedules import (
    build_scheduler,
    check_schedule,
    describe_batch_and_lr,
    lr_per_step,
    startup_line,
)
from tests.launch import ROOT, call, forked_ranks

DEBUG = str(ROOT / "recipes" / "debug.yaml")


def reference_lr(step, total, peak, cfg):
    """The LR of 0-based optimizer `step`, written out from the documented definitions (not from the code)."""
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total)
    if step < warmup:
        ramp = (step + 1) / (warmup + 1)
        return peak * {"linear": ramp, "quadratic": ramp * ramp, "constant": cfg.warmup_factor}[cfg.warmup]
    if cfg.name == "constant":
        return peak
    done = (step - warmup) / (total - warmup)
    shape = (1 + math.cos(math.pi * done)) / 2 if cfg.name == "warmup_cosine" else 1 - done
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


def torch_onecycle_lrs(total, peak, cfg):
    """LR used by each step of torch's own OneCycleLR, stepped once per optimizer step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=peak,
        total_steps=total,
        pct_start=cfg.pct_start,
        anneal_strategy=cfg.anneal,
        div_factor=cfg.div_factor,
        final_div_factor=cfg.final_div_factor,
        cycle_momentum=False,
    )
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def assert_close_all(actual, expected):
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= 1e-12 * max(abs(e), 1e-300), (step, a, e)


ONECYCLE = [
    dict(pct_start=0.1),
    dict(pct_start=0.3, anneal="linear"),
    dict(pct_start=0.25, div_factor=10.0, final_div_factor=100.0),
]


@pytest.mark.parametrize("kwargs", ONECYCLE)
@pytest.mark.parametrize("total", [2, 7, 100])
def test_onecycle_is_torch_onecycle_per_optimizer_step(kwargs, total):
    cfg = ScheduleConfig(name="onecycle", **kwargs)
    assert_close_all(lr_per_step(total, cfg, 3e-4), torch_onecycle_lrs(total, 3e-4, cfg))


def test_onecycle_scales_every_group_from_its_own_peak_and_keeps_momentum():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-4}], betas=(0.8, 0.95))
    cfg = ScheduleConfig(name="onecycle", pct_start=0.3)
    scheduler = build_scheduler(optimizer, 10, cfg)
    seen = []
    for _ in range(10):
        seen.append([g["lr"] for g in optimizer.param_groups])
        assert all(g["betas"] == (0.8, 0.95) for g in optimizer.param_groups)  # cycle_momentum=False
        optimizer.step()
        scheduler.step()
    assert_close_all([s[0] for s in seen], torch_onecycle_lrs(10, 1e-3, cfg))
    assert_close_all([s[1] for s in seen], torch_onecycle_lrs(10, 1e-4, cfg))


WARMED = [
    dict(name="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1),
    dict(name="warmup_cosine", warmup_ratio=0.05, warmup="quadratic"),
    dict(name="warmup_cosine", warmup_steps=3, warmup="constant", warmup_factor=0.2, min_lr_ratio=0.5),
    dict(name="linear", warmup_steps=7),
    dict(name="linear", warmup_ratio=0.2, warmup="quadratic", min_lr_ratio=0.01),
    dict(name="linear"),
    dict(name="constant", warmup_steps=5),
    dict(name="constant", warmup_ratio=0.1, warmup="quadratic"),
    dict(name="constant"),
]


@pytest.mark.parametrize("kwargs", WARMED, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_warmed_schedules_match_the_formula_at_every_step(kwargs):
    cfg = ScheduleConfig(**kwargs)
    total, peak = 97, 2e-4
    expected = [reference_lr(s, total, peak, cfg) for s in range(total)]
    assert_close_all(lr_per_step(total, cfg, peak), expected)
    if cfg.warmup_steps or cfg.warmup_ratio:
        assert expected[0] < peak and min(expected) > 0  # no step at LR 0


def test_scaling_rules_arithmetic():
    assert scaled_lr(1e-4, 1024, "linear", 256) == pytest.approx(4e-4, rel=1e-15)
    assert scaled_lr(1e-4, 1024, "sqrt", 256) == pytest.approx(2e-4, rel=1e-15)
    assert scaled_lr(3e-4, 96, "sqrt", 32) == pytest.approx(3e-4 * math.sqrt(3), rel=1e-15)
    assert scaled_lr(1e-4, 64, "linear", 256) == pytest.approx(2.5e-5, rel=1e-15)  # smaller batch: smaller LR
    assert scaled_lr(1e-4, 1024, "none", None) == 1e-4
    with pytest.raises(RecipeError, match="optim.base_batch_size"):
        scaled_lr(1e-4, 1024, "linear", None)


def test_start_up_line():
    line = describe_batch_and_lr(8, 16, 8, 1e-4, scaled_lr(1e-4, 1024, "linear", 256), "linear", 256, 1024)
    assert line == (
        "effective batch 1024 sequences = micro 8 × accumulation 16 × 8 ranks; lr 1e-4 → 4e-4 (linear rule, base 256)"
    )
    line = describe_batch_and_lr(
        "4096 tokens", 4, 2, 3e-4, scaled_lr(3e-4, 32768, "sqrt", 8192), "sqrt", 8192, 32768, "tokens"
    )
    assert line == (
        "effective batch 32768 tokens = micro 4096 tokens × accumulation 4 × 2 ranks; lr 3e-4 → 6e-4 "
        "(sqrt rule, base 8192 tokens)"
    )
    assert describe_batch_and_lr(4, 2, 1, 0.05, 0.05, "none", None, 8) == (
        "effective batch 8 sequences = micro 4 × accumulation 2 × 1 rank; lr 0.05"
    )


def test_start_up_line_of_a_token_budget_recipe_reads_the_base_in_tokens():
    cfg = load_config(
        [
            f"recipe={DEBUG}",
            "data.batching=token_budget",
            "data.max_tokens_per_micro_batch=512",
            "train.global_batch_tokens=4096",
            "optim.lr_scaling=linear",
            "optim.base_batch_size=2048",
        ]
    )
    assert peak_lr(cfg) == pytest.approx(2e-3, rel=1e-15)
    plan = resolve_plan(cfg, 1)
    assert (plan.accumulation, plan.peak_lr) == (8, peak_lr(cfg))
    assert startup_line(cfg.train, cfg.data, cfg.optim, plan, 10) == (
        "effective batch 4096 tokens = micro 512 tokens × accumulation 8 × 1 rank; "
        "lr 1e-3 → 2e-3 (linear rule, base 2048 tokens); 10 optimizer steps"
    )


# ---- through finetune/train.py, as users run it ----


def run(capfd, argv):
    """finetune/train.py's main on `argv`, in this process; it must succeed."""
    result = call(capfd, argv)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def train_rank(argv: list[str]) -> None:
    """One rank of a two-rank run (forked_ranks), as `accelerate launch finetune/train.py argv…` runs it."""
    assert train.main(argv) == 0


def logged(output_dir):
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    steps = [e for e in state["log_history"] if "loss" in e and "train_loss" not in e]
    return state, [e["learning_rate"] for e in steps], [e["step"] for e in steps]


@pytest.mark.e2e
@pytest.mark.distributed
def test_onecycle_on_two_cpu_ranks_with_accumulation_steps_once_per_optimizer_step(tmp_path, capfd):
    """64 rows, global batch 16 = micro 4 × accumulation 2 × 2 ranks: 4 optimizer steps per epoch, 2 epochs → 8."""
    out = tmp_path / "two"
    capfd.readouterr()
    forked_ranks(
        train_rank,
        [
            f"recipe={DEBUG}",
            "train.max_steps=-1",
            "train.epochs=2",
            "train.global_batch_size=16",
            "schedule.name=onecycle",
            "schedule.pct_start=0.3",
            "optim.name=lamb",
            "optim.lr_scaling=linear",
            "optim.base_batch_size=8",
            f"train.output_dir={out}",
        ],
        ACCELERATE_USE_CPU="true",
    )
    printed = capfd.readouterr().out
    assert (
        "effective batch 16 sequences = micro 4 × accumulation 2 × 2 ranks; lr 1e-3 → 2e-3 (linear rule, base 8)"
        "; 8 optimizer steps"
    ) in printed
    state, lrs, steps = logged(out)
    assert state["global_step"] == 8 and steps == list(range(1, 9))
    assert_close_all(lrs, torch_onecycle_lrs(8, 2e-3, ScheduleConfig(name="onecycle", pct_start=0.3)))


@pytest.mark.e2e
def test_warmup_cosine_with_accumulation_through_the_script(tmp_path, capfd):
    out = tmp_path / "one"
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=2, warmup="quadratic", min_lr_ratio=0.1)
    result = run(
        capfd,
        [
            f"recipe={DEBUG}",
            "train.max_steps=6",
            "train.global_batch_size=16",
            "schedule.name=warmup_cosine",
            "schedule.warmup_steps=2",
            "schedule.warmup=quadratic",
            "schedule.min_lr_ratio=0.1",
            "optim.name=lars",
            "optim.lr=0.5",
            "optim.lr_scaling=sqrt",
            "optim.base_batch_size=4",
            f"train.output_dir={out}",
        ],
    )
    assert "micro 4 × accumulation 4 × 1 rank; lr 0.5 → 1 (sqrt rule, base 4); 6 optimizer steps" in result.stdout
    state, lrs, steps = logged(out)
    assert steps == list(range(1, 7))
    assert_close_all(lrs, [reference_lr(s, 6, 1.0, cfg) for s in range(6)])


# ---- bad input: one clear error naming the key; exit 2 from the CLI ----

BAD = [
    (["schedule.name=onecycle", "schedule.pct_start=1.5"], "schedule.pct_start=1.5 must be in (0, 1)"),
    (["schedule.name=onecycle", "schedule.pct_start=0"], "schedule.pct_start=0.0 must be in (0, 1)"),
    (
        ["optim.name=lamb2"],
        "optim.name='lamb2' is not one of adamw, sgd, lamb, lars, adamw_8bit, paged_adamw_8bit, paged_adamw; "
        "did you mean 'lamb'?",
    ),
    (["schedule.name=cosine"], "schedule.name='cosine' is not one of"),
    (["optim.lr_scaling=sqrt"], "optim.lr_scaling=sqrt needs optim.base_batch_size"),
    (["optim.lr_scaling=linear", "optim.base_batch_size=0"], "needs optim.base_batch_size"),
    (["optim.lr_scaling=linear", "optim.base_batch_size=-8"], "optim.base_batch_size=-8 must be positive"),
    (["schedule.name=onecycle", "schedule.warmup_steps=3"], "schedule.warmup_steps does not apply to schedule.name="),
    (["schedule.warmup_ratio=1.0"], "schedule.warmup_ratio=1.0 must be in [0, 1)"),
    (["schedule.warmup_ratio=-0.1"], "schedule.warmup_ratio=-0.1 must be in [0, 1)"),
    (["schedule.warmup_steps=-2"], "schedule.warmup_steps=-2 must be ≥ 0"),
    (["optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m[:32] for _, m in BAD])
def test_bad_settings_fail_at_load_naming_the_key(argv, message):
    with pytest.raises(RecipeError) as error:
        load_config([f"recipe={DEBUG}", *argv])
    assert message in str(error.value)


def test_a_warmup_not_below_the_run_length_is_shortened_to_end_at_the_peak_with_one_note():
    note = check_schedule(10, ScheduleConfig(name="warmup_cosine", warmup_steps=10))
    assert note == (
        "note: schedule.warmup_steps=10 is not below the run's 10 optimizer steps; warming up over 9 steps instead "
        "(the last step at the peak lr)"
    )
    note = check_schedule(10, ScheduleConfig(name="linear", warmup_ratio=0.95))
    assert note.startswith("note: schedule.warmup_ratio=0.95 (10 steps) is not below the run's 10 optimizer steps; ")
    note = check_schedule(1, ScheduleConfig(name="constant", warmup_steps=3, warmup="constant"))
    assert note.startswith("note: schedule.warmup_steps=3 is not below the run's 1 optimizer step; no warmup instead")
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=5)
    assert_close_all(lr_per_step(3, cfg, 1.0), [1 / 3, 2 / 3, 1.0])  # warmup 2: (step + 1) / 3, then the peak
    assert lr_per_step(1, cfg, 1.0) == [1.0]
    assert "onecycle over 1 optimizer step" in check_schedule(1, ScheduleConfig(name="onecycle"))
    for total, cfg in [(10, ScheduleConfig(name="linear", warmup_steps=9)), (2, ScheduleConfig(name="onecycle"))]:
        assert check_schedule(total, cfg) is None  # below the run: as the recipe says, nothing to note
    cfg = ScheduleConfig(name="linear", warmup_steps=9)
    assert_close_all(lr_per_step(10, cfg, 1e-3), [reference_lr(s, 10, 1e-3, cfg) for s in range(10)])
    with pytest.raises(RecipeError, match="the run has 0 optimizer steps"):
        check_schedule(0, ScheduleConfig(name="linear"))


RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("total", [1, 2])
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_builds_its_schedule_for_a_1_and_a_2_step_run(recipe, total):
    cfg = load_config([f"recipe={recipe}", f"train.max_steps={total}"])
    note = check_schedule(total, cfg.schedule)
    asked = cfg.schedule.warmup_steps or math.ceil(cfg.schedule.warmup_ratio * total)
    if cfg.schedule.name == "onecycle":
        assert (note is not None) == (total == 1)
    elif asked >= total:
        key = f"schedule.warmup_steps={cfg.schedule.warmup_steps}"
        assert note.startswith(f"note: {key} is not below the run's {total} optimizer step"), note
        assert f"warming up over {total - 1} step instead" in note if total > 1 else "no warmup instead" in note
    else:
        assert note is None
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr(cfg))
    scheduler = build_scheduler(optimizer, total, cfg.schedule)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(total):  # the LR of steps 0..total (the last one past the run, where the scheduler ends)
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert all(math.isfinite(lr) and lr >= 0 for lr in lrs), lrs
    if cfg.schedule.name != "onecycle":
        assert lrs[total - 1] == pytest.approx(peak_lr(cfg))  # the warmup, shortened or not, ends at the peak


@pytest.mark.parametrize("total, pct_start", [(10, 0.1), (2, 0.5), (20, 0.05)])
def test_onecycle_whose_warmup_phase_is_one_step_builds(total, pct_start):
    """torch's OneCycleLR divides by zero where pct_start × total_steps is 1 (recipes/vlm_seed.yaml: 0.1 of 10): the
    one warm-up step at peak / div_factor, then the anneal from the peak."""
    cfg = ScheduleConfig(name="onecycle", pct_start=pct_start)
    lrs = lr_per_step(total, cfg, 1.0)
    assert lrs[0] == pytest.approx(1 / cfg.div_factor) and lrs[-1] == pytest.approx(1 / 25 / 1e4)
    assert all(math.isfinite(lr) for lr in lrs) and max(lrs) <= 1.0
    if total > 2:
        assert lrs[1] > 0.9 and lrs[1:] == sorted(lrs[1:], reverse=True)  # then the anneal


@pytest.mark.e2e
def test_a_2_step_run_with_a_5_step_warmup_trains_with_one_note(tmp_path, capfd):
    out = tmp_path / "out"
    argv = ["train.max_steps=2", "schedule.name=warmup_cosine", "schedule.warmup_steps=5", f"train.output_dir={out}"]
    result = run(capfd, [f"recipe={DEBUG}", *argv])
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in (result.stdout + result.stderr).splitlines() if "schedule.warmup_steps" in line]
    assert notes == [
        "note: schedule.warmup_steps=5 is not below the run's 2 optimizer steps; warming up over 1 step instead "
        "(the last step at the peak lr)"
    ]
    state, lrs, steps = logged(out)
    assert steps == [1, 2]
    assert_close_all(lrs, [5e-4, 1e-3])  # debug.yaml's optim.lr 1e-3: half at the one warmup step, then the peak


CLI_BAD = [
    (["schedule.warmup_steps=-1"], "schedule.warmup_steps=-1 must be ≥ 0"),
    (["schedule.name=onecycle", "schedule.pct_start=1.0"], "schedule.pct_start=1.0 must be in (0, 1)"),
    (["optim.name=lion"], "optim.name='lion' is not one of adamw, sgd, lamb, lars"),
    (["schedule.name=cosine_warmup"], "schedule.name='cosine_warmup' is not one of"),
    (["optim.lr_scaling=linear"], "optim.lr_scaling=linear needs optim.base_batch_size"),
]


@pytest.mark.parametrize("argv,message", CLI_BAD, ids=[m[:32] for _, m in CLI_BAD])
def test_bad_settings_through_the_cli_exit_2_with_one_line(argv, message, tmp_path, capfd):
    out = tmp_path / "out"
    result = call(capfd, [f"recipe={DEBUG}", *argv, f"train.output_dir={out}"])
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr[-3000:]
    assert not out.exists() or not any(out.iterdir())  # nothing written (train.py may probe the folder first)


def plot_schedule(capfd, monkeypatch, argv: list[str]) -> tuple[int, str, str]:
    """scripts/plot_schedule.py's main in this process, from the repository root: (exit code, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("plot_schedule", ROOT / "scripts" / "plot_schedule.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("WORLD_SIZE", "1")  # the script sets it to its `ranks`; restored after the test
    capfd.readouterr()
    code = script.main(argv)
    return code, *capfd.readouterr()


def test_plot_schedule_counts_steps_from_the_data_and_writes_a_png(tmp_path, capfd, monkeypatch):
    """An epoch-based run: 64 rows / (micro 4 × 2 ranks × accumulation 2) = 4 steps per epoch, 3 epochs."""
    png = tmp_path / "lr.png"
    code, stdout, stderr = plot_schedule(
        capfd,
        monkeypatch,
        [
            f"recipe={DEBUG}",
            "train.max_steps=-1",
            "train.epochs=3",
            "train.global_batch_size=16",
            "ranks=2",
            "schedule.name=warmup_cosine",
            "schedule.warmup_steps=2",
            f"out={png}",
        ],
    )
    assert code == 0, stdout[-3000:] + stderr[-6000:]
    assert "micro 4 × accumulation 2 × 2 ranks; lr 1e-3; 12 optimizer steps" in stdout
    assert "lr: first 3.333e-4, peak 1e-3, last 2.447e-5" in stdout  # 1e-3·(0+1)/(2+1); 1e-3·(1+cos 0.9π)/2
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 400
    code, _, stderr = plot_schedule(capfd, monkeypatch, [f"recipe={DEBUG}", "schedule.pct_start=2"])
    assert code == 2 and "schedule.pct_start=2.0 must be in (0, 1)" in stderr


@pytest.mark.parametrize("kwargs", [dict(name="onecycle", pct_start=0.3), dict(name="warmup_cosine", warmup_steps=3)])
def test_scheduler_state_resumes_through_a_weights_only_checkpoint(kwargs):
    """As the Trainer resumes: a fresh scheduler loads scheduler.pt (torch.load weights_only=True) and continues."""
    import io

    cfg, total = ScheduleConfig(**kwargs), 12

    def fresh():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        return optimizer, build_scheduler(optimizer, total, cfg)

    optimizer, scheduler = fresh()
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    buffers = [io.BytesIO(), io.BytesIO()]
    torch.save(optimizer.state_dict(), buffers[0])
    torch.save(scheduler.state_dict(), buffers[1])
    resumed_optimizer, resumed = fresh()
    resumed_optimizer.load_state_dict(torch.load(io.BytesIO(buffers[0].getvalue()), weights_only=True))
    resumed.load_state_dict(torch.load(io.BytesIO(buffers[1].getvalue()), weights_only=True))
    lrs = []
    for _ in range(5, total):
        lrs.append(resumed_optimizer.param_groups[0]["lr"])
        resumed_optimizer.step()
        resumed.step()
    assert_close_all(lrs, lr_per_step(total, cfg, 1e-3)[5:])
