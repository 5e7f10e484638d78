"""Evaluation in recipe runs: the held-out split (no row, no stdlib module on both sides), the eval loss as the exact
token mean of the held-out rows (float64 brute force, every eval batching mode), the eval series in trainer_state.json
and in the offline W&B run, the samples table, the best model and early stopping resumed exactly, a VLM's image
samples, plot_run's eval curve, and bad eval input (one line, exit 2, nothing written)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.data.report import DataReport
from finetune.data.sources import read_records
from finetune.data.training_set import QUESTION_MODULE, split_records
from finetune.evaluation.sets import eval_groups, pad_for_ranks
from finetune.recipe import Batching, DataConfig, load_config
from finetune.testing.reference import reference_gradient
from finetune.tools import train
from tests.data_files import chat, write_jsonl
from tests.launch import call, forked_ranks
from tests.wandb_reader import read_run

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ["recipe=recipes/debug.yaml", "log.wandb_mode=disabled"]
HELD_OUT = ["eval.fraction=0.25", "eval.samples=0"]


def module_of(record) -> str:
    return QUESTION_MODULE.search(record[1]["messages"][0]["content"]).group(1)


def targets(rows) -> int:
    return sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)


def eval_rows(trainer) -> list[dict]:
    """The real rows of the trainer's eval set (not the target-free rows that pad it to the ranks)."""
    return [r for r in trainer.eval_dataset.rows if any(t != -100 for t in r["labels"])]


def eval_entries(history) -> list[dict]:
    return [e for e in history if "eval_loss" in e]


# ---- the split ----


def test_held_out_stdlib_modules_are_never_trained_on_and_the_split_is_seeded():
    records = read_records(DataConfig(source="stdlib_docs"), DataReport())
    train_rows, held, how = split_records(records, 0.1, 0, "stdlib_docs")
    assert not {module_of(r) for r in train_rows} & {module_of(r) for r in held}
    assert len(train_rows) + len(held) == len(records) and "modules) held out of stdlib_docs" in how
    assert 0.05 * len(records) <= len(held) <= 0.1 * len(records)  # whole modules, as many as fit the share
    assert sorted(w for w, _ in records) == sorted(w for w, _ in train_rows + held)  # a row is on one side only
    assert split_records(records, 0.1, 0, "stdlib_docs")[1] == held
    assert split_records(records, 0.1, 1, "stdlib_docs")[1] != held


def test_identical_rows_of_a_file_are_held_out_together():
    records = [(f"rows.jsonl line {i + 1}", {"text": f"row {i % 7}"}) for i in range(70)]  # 7 rows, 10 copies each
    train_rows, held, _ = split_records(records, 0.3, 0, "rows.jsonl")
    assert len(held) == 20 and not {r["text"] for _, r in train_rows} & {r["text"] for _, r in held}


def test_eval_micro_batches_follow_the_batching_mode_and_pad_to_the_ranks_without_targets():
    lengths = [5, 3, 8, 2, 7]
    assert eval_groups(lengths, Batching("packed", 2, None), 0) == [[0, 1], [2, 3], [4]]
    assert eval_groups(lengths, Batching("length_grouped", 2, None), 0) == [[2, 4], [0, 1], [3]]
    budget = eval_groups(lengths, Batching("token_budget", 8, 10), 0)
    assert sorted(i for g in budget for i in g) == [0, 1, 2, 3, 4]
    assert all(len(g) * max(lengths[i] for i in g) <= 10 for g in budget)
    rows = [{"input_ids": list(range(n)), "labels": list(range(n))} for n in lengths]
    groups = eval_groups(lengths, Batching("padded", 2, None), 0)
    pad_for_ranks(rows, groups, 2)
    assert groups == [[0, 1], [2, 3], [4], [5]] and rows[5] == {"input_ids": [0, 1], "labels": [-100, -100]}
    pad_for_ranks(rows, groups, 2)
    assert len(groups) == 4  # already a multiple


def test_eval_fraction_0_alone_turns_evaluation_off_and_says_which_keys_it_ignores(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["train.max_steps=1", "eval.fraction=0", "eval.every_steps=5", "eval.samples=0", "eval.limit=4"]
    assert train.main([*DEBUG, f"train.output_dir={out}", *args]) == 0
    console = capsys.readouterr().out
    note = "note: no eval set (eval.fraction=0, no eval.source): eval.every_steps, eval.limit, eval.samples ignored"
    assert note in console.splitlines()
    assert "eval:" not in console and "eval_loss" not in (out / "trainer_state.json").read_text()


# ---- bad input: one line, exit code 2, nothing written ----


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval.source=/nowhere/eval.jsonl"], "eval.source=/nowhere/eval.jsonl: no such file or folder"),
        (["eval.fraction=0.2", "eval.source=x.jsonl"], "set eval.source (a separate eval set) or eval.fraction"),
        (
            ["eval.fraction=0.2", "data.streaming=true", "data.source=x.jsonl"],
            "which data.streaming=true reads only as",
        ),
        (["eval.fraction=0.2", "eval.early_stopping_patience=2"], "eval.early_stopping_patience counts evaluations"),
        (["eval.fraction=1.5"], "eval.fraction=1.5 must be in [0, 1) (the share of data.source held out)"),
        (["eval.fraction=0.2", "eval.batching=token_budget"], "eval.batching=token_budget needs eval.max_tokens_per"),
        (["eval.fraction=0.001"], "eval.fraction=0.001 of the 64 rows of data.source=stdlib_docs holds out no row"),
    ],
    ids=["missing", "both", "stream", "patience", "fraction", "budget", "too-small"],
)
def test_bad_eval_keys_are_one_line_exit_2_nothing_written(args, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main([*DEBUG, f"train.output_dir={out}", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_an_eval_source_empty_after_filtering_or_overlapping_training_is_an_error(tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"What is {k}?", f"It is {k}.") for k in range(8)])
    long = write_jsonl(tmp_path / "long.jsonl", [chat("Say a lot.", "word " * 400)])
    leak = write_jsonl(tmp_path / "leak.jsonl", [chat("What is 3?", "It is 3."), chat("What is 9?", "It is 9.")])
    for source, extra, phrase in [
        (long, ["data.truncation=drop"], "no rows left ("),
        (leak, [], "1 of the 2 eval rows are also training rows"),
    ]:
        out = tmp_path / "out"
        code = train.main([*DEBUG, f"data.source={data}", f"eval.source={source}", f"train.output_dir={out}", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: eval.source={source}: "), err
        assert phrase in err and not out.exists()


# ---- the eval loss: exact, in every batching mode ----


@pytest.mark.e2e
@pytest.mark.parametrize(
    "mode",
    [
        ["eval.batching=packed", "eval.micro_batch_size=3"],
        ["eval.batching=padded", "eval.micro_batch_size=5"],
        ["eval.batching=length_grouped"],
        ["eval.batching=token_budget", "eval.max_tokens_per_micro_batch=256"],
        ["eval.batching=packed", "eval.max_tokens_per_micro_batch=200"],
    ],
    ids=["packed", "padded", "length_grouped", "token_budget", "packed-budget"],
)
def test_eval_loss_is_the_float64_token_mean_of_the_held_out_rows(mode, tmp_path):
    from finetune.assemble import build

    trainer = build(load_config([*DEBUG, *HELD_OUT, f"train.output_dir={tmp_path}", *mode]))
    metrics = trainer.evaluate()
    rows = eval_rows(trainer)
    _, reference = reference_gradient(trainer.model, rows)
    assert abs(metrics["eval_loss"] - reference) / reference <= 1e-6, (metrics["eval_loss"], reference)
    assert metrics["eval_label_tokens"] == targets(rows)
    assert metrics["eval_perplexity"] == math.exp(metrics["eval_loss"])
    training = {tuple(r["input_ids"]) for r in trainer.train_dataset}
    assert len(rows) == 12 and not training & {tuple(r["input_ids"]) for r in rows}  # no row in both


# ---- a whole run: the eval series, W&B, the samples table, timings, the plot ----


@pytest.mark.e2e
def test_a_run_logs_its_evaluations_to_the_console_trainer_state_wandb_and_a_samples_table(tmp_path, capfd):
    out = tmp_path / "run"
    args = [
        *DEBUG,
        *HELD_OUT,
        "log.wandb_mode=offline",
        "eval.every_steps=3",
        "eval.samples=2",
        "eval.prompts=[Say hi.]",
        "eval.max_new_tokens=6",
        "eval.best_checkpoint=true",
        f"train.output_dir={out}",
    ]
    result = call(capfd, args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = eval_entries(history)
    assert [e["step"] for e in evals] == [0, 3, 4]  # before the first step, every 3 steps, at the end
    for e in evals:
        assert e["eval_perplexity"] == math.exp(e["eval_loss"]) and e["eval_label_tokens"] > 0
        assert not {k for k in e if k.endswith(("_runtime", "_per_second", "_per_s"))}  # timings: not here
    console = result.stdout
    assert "eval at step 0/4  loss " in console and "eval at step 4/4  loss " in console
    assert console.count("  held out 1: What ") == 3 and console.count("  prompt 1: Say hi.") == 3
    for row in ("eval loss", "eval perplexity", "eval targets", "best model"):
        assert f"  {row} " in console

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    wandb_history, _, summary = read_run(run_file)
    rows = [h for h in wandb_history if "eval/loss" in h]
    assert [r["train/global_step"] for r in rows] == [0, 3, 4]
    for row, entry in zip(rows, evals):
        assert row["eval/loss"] == pytest.approx(entry["eval_loss"], rel=1e-12)
        assert row["eval/perplexity"] == pytest.approx(entry["eval_perplexity"], rel=1e-12)
        assert row["eval/label_tokens"] == entry["eval_label_tokens"] and row["eval/tokens_per_s"] > 0
    assert summary["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
    assert summary["eval_loss_first"] == pytest.approx(evals[0]["eval_loss"])
    tables = [h for h in wandb_history if "eval/samples/path" in h]  # a table is a file the history points to
    assert [h["train/global_step"] for h in tables] == [0, 3, 4] and tables[-1]["eval/samples/_type"] == "table-file"
    table = json.loads((run_file.parent / "files" / tables[-1]["eval/samples/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "output", "reference"]
    assert [r[0] for r in table["data"]] == [0, 0, 0, 3, 3, 3, 4, 4, 4]
    held = [r for r in table["data"] if r[1] != "Say hi."]
    assert all(r[1].startswith("What ") and r[3] for r in held) and len({r[1] for r in held}) == 2
    assert all(isinstance(r[2], str) for r in table["data"])

    # the last sample is what the saved model generates greedily from that prompt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        new = model.generate(**prompt, max_new_tokens=6, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert table["data"][-1][2] == tokenizer.decode(new, skip_special_tokens=True).strip()

    best = json.loads((out / "best" / "best.json").read_text())
    lowest = min(evals[1:], key=lambda e: e["eval_loss"])
    assert best == {"step": lowest["step"], "eval_loss": lowest["eval_loss"]}
    timings = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timings if "eval_tokens_per_s" in t] == [0, 3, 4]
    assert [t["step"] for t in timings if "real_tokens_per_s" in t] == [1, 2, 3, 4]

    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_run", ROOT / "scripts" / "plot_run.py")
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    steps, plotted = plot_run.load_steps(str(out)), plot_run.load_evals(str(out))
    fig = plot_run.figure(steps, "run", plotted)
    loss_lines, speed_lines = fig.axes[0].get_lines(), fig.axes[3].get_lines()
    assert list(loss_lines[1].get_xdata()) == [0, 3, 4]
    assert list(loss_lines[1].get_ydata()) == [e["eval_loss"] for e in evals]
    assert [len(line.get_xdata()) for line in speed_lines] == [4, 4, 3]  # real, computed, eval tokens/s


# ---- best model, early stopping, resume ----


EARLY = [
    *DEBUG,
    *HELD_OUT,
    "data.max_length=64",
    "train.max_steps=8",
    "optim.lr=3e-2",
    "eval.every_steps=1",
    "eval.best_checkpoint=true",
    "eval.early_stopping_patience=2",
    "train.save_steps=1",
]


@pytest.mark.e2e
def test_best_model_and_early_stopping_resume_exactly(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as many threads as a resumed subprocess run would use
    try:
        whole = tmp_path / "whole"
        assert train.train(load_config([*EARLY, f"train.output_dir={whole}"])) == 0
        state = json.loads((whole / "trainer_state.json").read_text())
        evals = eval_entries(state["log_history"])
        losses = [e["eval_loss"] for e in evals]
        best = 1 + losses[1:].index(min(losses[1:]))
        # stopped after two evaluations without a lower loss than the best one (this recipe: best at 2, stop at 4)
        assert state["global_step"] == best + 2 < 8 and [e["step"] for e in evals] == list(range(best + 3))
        assert state["best_global_step"] == best and state["best_metric"] == losses[best]
        assert json.loads((whole / "best" / "best.json").read_text()) == {"step": best, "eval_loss": losses[best]}
        saved, at_best = (
            load_file(whole / "best" / "model.safetensors"),
            load_file(whole / f"checkpoint-{best}" / "model.safetensors"),
        )
        assert all(torch.equal(saved[n], at_best[n]) for n in at_best)

        resumed = tmp_path / "resumed"  # what a run killed after its checkpoint at best + 1 left behind
        resumed.mkdir()
        for name in (f"checkpoint-{best + 1}", "best"):
            shutil.copytree(whole / name, resumed / name)
        assert train.train(load_config([*EARLY, f"train.output_dir={resumed}", "train.resume_from=auto"])) == 0
    finally:
        torch.set_num_threads(threads)

    def history(folder):
        skip = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")
        entries = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        return [{k: v for k, v in e.items() if k not in skip} for e in entries]

    assert history(resumed) == history(whole)  # the evaluations too, the one before the first step once
    for name in ("model.safetensors", "best/model.safetensors"):
        got, want = load_file(resumed / name), load_file(whole / name)
        assert all(torch.equal(got[n], want[n]) for n in want), name


# ---- streaming with a separate eval set, a VLM's image samples ----


@pytest.mark.e2e
def test_streamed_training_evaluates_on_a_separate_eval_source(tmp_path):
    from finetune.assemble import build

    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"What is {k}?", f"It is {k}.") for k in range(16)])
    held = write_jsonl(tmp_path / "eval.jsonl", [chat(f"What is {k}?", f"It is {k}.") for k in range(16, 21)])
    cfg = load_config(
        [
            *DEBUG,
            f"data.source={data}",
            "data.streaming=true",
            "data.batching=padded",
            f"eval.source={held}",
            "eval.samples=1",
            "eval.max_new_tokens=2",
            "train.max_steps=2",
            f"train.output_dir={tmp_path / 'out'}",
        ]
    )
    trainer = build(cfg)
    trainer.train()
    evals = eval_entries(trainer.state.log_history)
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["eval_label_tokens"] == targets(eval_rows(trainer))


@pytest.mark.e2e
def test_a_vlm_generates_samples_from_held_out_images(tiny_vlm_folder, tmp_path):
    from finetune.assemble import build
    from finetune.evaluation.samples import GenerateSamples

    cfg = load_config(
        [
            f"model.name_or_path={tiny_vlm_folder}",
            "data.source=shapes_captions",
            "data.limit=16",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.max_steps=1",
            f"train.output_dir={tmp_path}",
            "log.wandb_mode=disabled",
            "eval.fraction=0.25",
            "eval.samples=2",
            "eval.max_new_tokens=3",
            "eval.prompts=[Describe the image.]",
        ]
    )
    trainer = build(cfg)
    trainer.train()
    evals = eval_entries(trainer.state.log_history)
    assert [e["step"] for e in evals] == [0, 1] and evals[0]["eval_label_tokens"] == targets(eval_rows(trainer))
    (samples,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, GenerateSamples)]
    assert "pixel_values" in samples.prompts[0].inputs and "pixel_values" not in samples.prompts[2].inputs
    assert [r[0] for r in samples.rows] == [0, 0, 0, 1, 1, 1]
    held = [r for r in samples.rows if r[3]]
    assert len(held) == 4 and all(r[1].startswith("[image] ") and r[3].endswith(".") for r in held)
    trainer.model.train()
    samples.on_evaluate(
        trainer.args, trainer.state, trainer.control, model=trainer.model, processing_class=trainer.processing_class
    )
    assert trainer.model.training and len(samples.rows) == 9  # back in the mode it was in


# ---- the tools with eval keys ----


@pytest.mark.e2e
def test_verify_and_plan_work_with_eval_keys(tmp_path, capsys):
    from finetune.tools import plan, verify

    assert verify.main([*DEBUG, *HELD_OUT, "eval.every_steps=1"]) == 0
    assert "verify: PASS" in capsys.readouterr().out
    assert plan.main([*DEBUG, *HELD_OUT, "eval.micro_batch_size=4"]) == 0
    shown = capsys.readouterr().out
    assert "eval: micro-batch of 4 rows" in shown and "KV cache" in shown


def train_passes(argv: list[str]) -> None:
    """One rank of a two-rank training command: it must succeed."""
    assert train.main(argv) == 0


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_ranks_evaluate_every_held_out_row_once(tmp_path, capfd):
    """12 eval rows in 3 micro-batches on 2 ranks: a fourth, target-free one pads them, so no rank repeats a row; the
    samples run the same number of steps on both ranks (no hang)."""
    common = [
        *DEBUG,
        *HELD_OUT,
        "eval.micro_batch_size=5",
        "eval.samples=1",
        "eval.max_new_tokens=3",
        "train.max_steps=2",
        "optim.name=sgd",
        "optim.lr=0.5",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    result = call(capfd, [*common, f"train.output_dir={one}"], ACCELERATE_USE_CPU="true")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    forked_ranks(train_passes, [*common, f"train.output_dir={two}"], ACCELERATE_USE_CPU="true")
    evals = [eval_entries(json.loads((out / "trainer_state.json").read_text())["log_history"]) for out in (one, two)]
    assert [e["step"] for e in evals[1]] == [e["step"] for e in evals[0]] == [0, 2]
    for a, b in zip(*evals):
        assert b["eval_label_tokens"] == a["eval_label_tokens"]
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
