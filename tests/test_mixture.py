"""data.mixture and named eval sets through the training command on the debug recipe: rows drawn at the weights'
shares (seeded, whole passes first), one exact eval loss per named set and over all of them, a bitwise resume, and
bad mixtures refused in one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.data.mixture import drawn_counts, drawn_rows
from finetune.tools import train

DEBUG = ["recipe=recipes/debug.yaml", "log.wandb_mode=disabled", "data.max_length=64", "train.max_steps=4"]


def chat_file(path: Path, n: int) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {k} plus {k}?"},
                {"role": "assistant", "content": f"{2 * k}."},
            ]
        }
        for k in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mixture_args(tmp_path: Path) -> list[str]:
    sums = chat_file(tmp_path / "sums.jsonl", 24)
    return [
        f"data.mixture=[{{source: stdlib_docs, weight: 0.7, name: docs}}, {{source: {sums}, weight: 0.3}}]",
        "data.limit=40",
        "eval.fraction=0.2",
        "eval.every_steps=2",
        "eval.samples=0",
    ]


def test_drawn_counts_follow_the_weights_and_add_up_to_all_kept_rows():
    assert drawn_counts([40, 20], [0.7, 0.3]) == [42, 18]
    assert drawn_counts([10, 10, 10], [1, 1, 1]) == [10, 10, 10]
    assert sum(drawn_counts([7, 5, 3], [0.5, 0.25, 0.25])) == 15
    rows = drawn_rows(5, 12, seed=0, name="a")  # two whole passes, then 2 rows sampled without repeats
    assert rows[:10] == list(range(5)) * 2 and len(set(rows[10:])) == 2
    assert rows == drawn_rows(5, 12, seed=0, name="a") and rows != drawn_rows(5, 12, seed=1, name="a")


@pytest.mark.e2e
def test_a_70_30_mixture_with_two_named_eval_sets_logs_each_and_their_token_mean(tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main([*DEBUG, *mixture_args(tmp_path), f"train.output_dir={out}"]) == 0
    console = capsys.readouterr().out
    data_line = next(line for line in console.splitlines() if line.startswith("data: mixture of 2 sources"))
    assert "docs: " in data_line and "sums: " in data_line and "passes over its" in data_line
    assert any(line.startswith("eval docs: ") for line in console.splitlines())
    assert any(line.startswith("eval sums: ") for line in console.splitlines())
    assert any(
        "eval at step 2/4" in line and "| docs loss " in line and "| sums loss " in line
        for line in console.splitlines()
    )
    evals = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_loss" in e]
    assert [e["step"] for e in evals] == [0, 2, 4]
    for e in evals:
        docs, sums = e["eval_docs_label_tokens"], e["eval_sums_label_tokens"]
        assert docs > 0 and sums > 0 and e["eval_label_tokens"] == docs + sums
        whole = (e["eval_docs_loss"] * docs + e["eval_sums_loss"] * sums) / (docs + sums)
        assert abs(e["eval_loss"] - whole) <= 1e-12 * whole
        assert e["eval_docs_perplexity"] == pytest.approx(torch.tensor(e["eval_docs_loss"]).exp().item())
        assert 0 <= e["eval_sums_token_accuracy"] <= 1


@pytest.mark.e2e
def test_a_mixture_run_resumes_bitwise(tmp_path):
    args = [*DEBUG, *mixture_args(tmp_path), "eval.fraction=0.2", "train.save_steps=1"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert train.main([*args, f"train.output_dir={reference}"]) == 0
    resumed.mkdir()
    shutil.copytree(reference / "checkpoint-2", resumed / "checkpoint-2")
    assert train.main([*args, f"train.output_dir={resumed}", "train.resume_from=auto"]) == 0
    history = [json.loads((d / "trainer_state.json").read_text())["log_history"] for d in (reference, resumed)]
    steps = [[(e["step"], e["loss"], e["grad_norm"]) for e in h if "grad_norm" in e] for h in history]
    assert steps[1] == steps[0] and len(steps[0]) == 4  # the resumed history holds steps 1-2 from the checkpoint
    got, want = load_file(resumed / "model.safetensors"), load_file(reference / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    "mixture, message",
    [
        ("[{source: stdlib_docs, weight: 0}]", "data.mixture[0].weight=0.0 must be positive and finite"),
        ("[{source: stdlib_docs, weight: .nan}]", "data.mixture[0].weight=nan must be positive and finite"),
        ("[{source: stdlib_docs}, {source: stdlib_docs}]", "data.mixture: two sources are named 'stdlib_docs'"),
    ],
    ids=["zero", "nan", "same-name"],
)
def test_bad_mixtures_are_one_line_exit_2_nothing_written(mixture, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main([*DEBUG, f"data.mixture={mixture}", f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_a_named_eval_set_that_shares_rows_with_training_is_one_error(tmp_path, capsys):
    sums = chat_file(tmp_path / "sums.jsonl", 24)
    out = tmp_path / "out"
    args = [f"data.source={sums}", f"eval.sets={{leak: {sums}}}", f"train.output_dir={out}"]
    assert train.main([*DEBUG, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: eval.sets.leak=") and "also training rows" in err and err.count("\n") == 1, err
    assert not out.exists()
