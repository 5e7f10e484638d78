"""--help of every command (generated from the schema) and finetune-train --dry-run (the resolved recipe and its plan):
in this process, each entry point's page included; one subprocess for the entry script as users start it."""

import dataclasses
import re
import runpy
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from finetune.recipe import Config, MixtureSource, RecipeError, accumulation_steps, load_config, resolve_plan
from finetune.recipe.loading import _all_keys
from finetune.recipe.usage import help_request, help_text, schema_keys, sections
from finetune.tools import dry_run, plan, train, verify

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"train": train.COMMAND, "plan": plan.COMMAND, "verify": verify.COMMAND}
SCRIPT = str(ROOT / "finetune" / "train.py")


def run_train_script() -> None:
    runpy.run_path(SCRIPT, run_name="__main__")


def run_console_main() -> None:  # as the finetune-train console script calls it: main() reads sys.argv
    sys.exit(train.main())


# each entry point, run in this process with sys.argv as its process would see it
ENTRIES = {
    "train.py": run_train_script,
    "finetune.tools.train": run_console_main,
    "plan": lambda: runpy.run_module("finetune.plan", run_name="__main__"),
    "verify": lambda: runpy.run_module("finetune.verify", run_name="__main__"),
}


def every_schema_key() -> list[str]:
    """The schema's keys as OmegaConf loads them (sections included), and data.mixture's entry keys."""
    keys = _all_keys(OmegaConf.structured(Config))
    return keys + [f"data.mixture[].{f.name}" for f in fields(MixtureSource)]


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_help_lists_every_key_with_its_help(command):
    text = help_text(command)
    assert text.startswith(f"usage: {command.name} recipe=")
    for key in every_schema_key():
        assert re.search(rf"^ *{re.escape(key)}:", text, re.M), key
    assert set(schema_keys()) <= set(every_schema_key())
    lines = text.splitlines()
    for key in schema_keys():  # each key's line is followed by its one-line description
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
        assert lines[at + 1].strip(), f"{key} has no help="
    for key in command.keys:
        assert f"{command.tool}.{key.name}: " in text


def test_help_shows_defaults_choices_and_bounds():
    text = help_text(train.COMMAND)
    assert "  train.precision: fp32 | bf16 | fp16 = fp32\n      mixed precision" in text
    assert "  model.name_or_path: str = (required)\n" in text
    assert "  optim.lr: float, positive = 0.0001\n" in text
    assert "--dry-run" in text


def test_every_section_has_a_summary():
    for name, cls in sections().items():
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), name


def test_help_narrows_to_a_section():
    text = help_text(train.COMMAND, "model")
    assert "model.lora.r:" in text and "model.dtype:" in text
    assert "train." not in text and "options:" not in text
    assert "plan.headroom" in help_text(plan.COMMAND, "plan") and "model." not in help_text(plan.COMMAND, "plan")
    with pytest.raises(RecipeError, match="--help trian: no such section; one of model, data, train"):
        help_text(train.COMMAND, "trian")


@pytest.mark.parametrize(
    "argv, asked",
    [
        (["--help"], (True, None)),
        (["-h"], (True, None)),
        (["recipe=debug", "--help", "train"], (True, "train")),
        (["--help=optim"], (True, "optim")),
        (["--help", "optim.lr=1"], (True, None)),
        (["recipe=debug", "--helpme"], (False, None)),
    ],
)
def test_help_request(argv, asked):
    assert help_request(argv) == asked


def dry_run_page(capsys, argv: list[str]) -> tuple[Config, str, list[str]]:
    cfg = load_config(argv)
    assert dry_run.dry_run(cfg, resolve_plan(cfg, 1)) == 0
    out = capsys.readouterr().out
    return cfg, out, [line.removeprefix("#   ") for line in out.splitlines() if line.startswith("#   ")]


def test_dry_run_prints_a_recipe_that_loads_back_the_same(capsys, tmp_path):
    cfg, out, _ = dry_run_page(capsys, ["recipe=recipes/debug.yaml", "optim.lr=3e-4", "data.limit=32"])
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    again = load_config([f"recipe={printed}"])
    assert dataclasses.replace(again, recipe=cfg.recipe) == cfg
    assert again.optim.lr == 3e-4


def test_dry_run_plan_is_what_the_trainer_derives(capsys):
    cfg, _, plan_lines = dry_run_page(capsys, ["recipe=recipes/debug.yaml"])
    found = re.match(r"effective batch (\d+) sequences = micro (\d+) × accumulation (\d+) × (\d+) rank", plan_lines[0])
    total, micro, accumulation, ranks = map(int, found.groups())
    assert accumulation == accumulation_steps(cfg, ranks) and ranks == 1
    assert total == micro * accumulation * ranks == cfg.train.global_batch_size
    assert micro == cfg.train.micro_batch_size
    assert f"; {cfg.train.max_steps} optimizer steps (train.max_steps)" in plan_lines[0]
    assert plan_lines[1] == "warmup 0 optimizer steps (linear); schedule constant"
    assert plan_lines[2] == "precision fp32 (weights loaded in float32)"


def test_dry_run_shows_the_first_rows_with_their_targets_marked(capsys):
    from finetune.assemble import load_tokenizer
    from finetune.data.text import load_sft_dataset

    cfg, out, _ = dry_run_page(capsys, ["recipe=recipes/debug.yaml", "data.loss_on=completion"])
    shown = out.split("as they train (targets between ⟦ and ⟧):\n", 1)[1]
    rows = [row.replace("\n# ", "\n").removeprefix("# ") for row in shown.split("# row ")[1:]]
    assert len(rows) == 2
    _, _, tokenizer = load_tokenizer(cfg.model, cfg.data, cfg.train, resolve_plan(cfg, 1))
    dataset, _ = load_sft_dataset(dataclasses.replace(cfg.data, limit=2), tokenizer)
    for k, (text, row) in enumerate(zip(rows, dataset), 1):
        targets = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        inside = "".join(text.split("⟦")[1:]).split("⟧")[0]
        assert text.startswith(f"{k}:\n") and text.count("⟦") == 1
        assert inside == tokenizer.decode(targets)  # what is marked is what trains, token for token


def test_dry_run_counts_epochs_as_build_does(capsys):
    """max_steps=-1: the steps come from the data, counted as build counts them (the tokenizer and rows load)."""
    from finetune.assemble import load_data, load_tokenizer
    from finetune.data import batching

    argv = ["recipe=recipes/debug.yaml", "train.max_steps=-1", "train.epochs=2", "schedule.warmup_ratio=0.2"]
    cfg, _, plan_lines = dry_run_page(capsys, argv)
    plan = resolve_plan(cfg, 1)
    _, rows, tokenizer = load_tokenizer(cfg.model, cfg.data, cfg.train, plan)
    batches = load_data(cfg.data, cfg.eval, cfg.train.seed, plan, tokenizer, rows, evaluate=False).batches
    steps = batching.count_optimizer_steps(cfg.train, batches, 1, plan.accumulation)
    assert f"; {steps} optimizer steps (train.epochs=2, counted from the data)" in plan_lines[0]
    assert plan_lines[1].startswith(f"warmup {-(-steps // 5)} optimizer step")


def run_entry(capfd, monkeypatch, cwd: Path, entry, argv: list[str]) -> subprocess.CompletedProcess:
    """An entry point in this process, from `cwd`, as `python ENTRY argv…` runs it: its exit code and output."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["entry", *argv])
    capfd.readouterr()
    try:
        entry()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


@pytest.mark.parametrize("entry", ENTRIES.values(), ids=ENTRIES.keys())
def test_help_on_each_entry_point(entry, tmp_path, capfd, monkeypatch):
    result = run_entry(capfd, monkeypatch, tmp_path, entry, ["--help"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: finetune-") and "train.global_batch_size: int" in result.stdout
    assert result.stderr == ""


@pytest.mark.subprocess  # the entry script started as users start it, from another folder: its imports at start-up
def test_help_of_the_entry_script_in_its_own_process(tmp_path):
    result = subprocess.run(
        [sys.executable, SCRIPT, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: finetune-") and "train.global_batch_size: int" in result.stdout
    assert result.stderr == ""


def test_dry_run_and_an_unknown_flag_end_to_end(tmp_path, capfd, monkeypatch):
    result = run_entry(capfd, monkeypatch, tmp_path, run_train_script, ["recipe=debug", "--dry-run"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "# plan (--dry-run" in result.stdout and not (tmp_path / "outputs").exists()
    result = run_entry(capfd, monkeypatch, tmp_path, run_train_script, ["recipe=debug", "--dry-rum"])
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: argument '--dry-rum' is not key=value; write e.g. optim.lr=1e-5 or recipe=recipes/debug.yaml"
    )
