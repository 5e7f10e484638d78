"""End to end through `finetune/train.py`'s main, as users run it: in this process, and on two forked CPU ranks."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.tools import train
from tests.launch import call, forked_ranks


def trained(capfd, argv, **environ):
    result = call(capfd, argv, **environ)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return result


def train_rank(argv: list[str]) -> None:
    """One rank of a two-rank run (forked_ranks), as `accelerate launch finetune/train.py argv…` runs it."""
    assert train.main(argv) == 0


def step_logs(output_dir):
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [e for e in state["log_history"] if "loss" in e and "train_loss" not in e]


@pytest.mark.e2e
def test_debug_recipe_end_to_end(tmp_path, capfd):
    out = tmp_path / "debug"
    result = trained(capfd, ["recipe=recipes/debug.yaml", f"train.output_dir={out}"])
    logs = step_logs(out)
    assert [e["step"] for e in logs] == [1, 2, 3, 4]
    for entry in logs:
        assert {"loss", "grad_norm", "learning_rate", "window_label_tokens"} <= entry.keys()
        assert entry["window_label_tokens"] > 0 and torch.isfinite(torch.tensor(entry["loss"]))
    assert "effective batch 8 sequences = micro 4 × accumulation 2 × 1 rank" in result.stdout
    assert (out / "model.safetensors").is_file() and (out / "recipe.yaml").is_file()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_ranks_match_one_process(tmp_path, capfd):
    """The same recipe on 1 and on 2 CPU ranks (real DDP on gloo): same per-step loss and final weights."""
    common = ["recipe=recipes/debug.yaml", "train.max_steps=3", "optim.name=sgd", "optim.lr=0.5"]
    one, two = tmp_path / "one", tmp_path / "two"
    trained(capfd, [*common, f"train.output_dir={one}"])
    forked_ranks(train_rank, [*common, f"train.output_dir={two}"], ACCELERATE_USE_CPU="true")
    one_logs, two_logs = step_logs(one), step_logs(two)
    assert len(one_logs) == len(two_logs) == 3
    for a, b in zip(one_logs, two_logs):
        assert b["window_label_tokens"] == a["window_label_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
@pytest.mark.slow  # slow: loads and trains SmolLM2-135M, the real model
def test_quickstart_on_the_real_model_saves_a_model_that_reloads_and_generates(tmp_path, capfd):
    """SmolLM2-135M-Instruct from the GGUF, two short steps, W&B offline; then reload and chat."""
    out = tmp_path / "quick"
    result = trained(
        capfd,
        [
            "recipe=recipes/quickstart.yaml",
            f"train.output_dir={out}",
            "train.max_steps=2",
            "schedule.warmup_steps=1",
            "train.global_batch_size=2",
            "train.micro_batch_size=1",
            "data.max_length=64",
            "data.limit=32",
        ],
        WANDB_MODE="offline",
    )
    assert len(step_logs(out)) == 2
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [e for e in history if "eval_loss" in e]  # held-out rows, before the first step and at the end
    assert [e["step"] for e in evals] == [0, 2] and all(e["eval_label_tokens"] > 0 for e in evals)
    assert "eval at step 0/2  loss " in result.stdout and result.stdout.count("  held out 1: What ") == 2
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and f"wandb sync {runs[0]}" in result.stdout

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does `json.dumps` do?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(answer.strip()) > 0
