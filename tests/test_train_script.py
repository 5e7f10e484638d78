"""End to end through `finetune/train.py`, in subprocesses, as users run it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import TWO_RANKS

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, env=None, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return result


def step_logs(output_dir):
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [e for e in state["log_history"] if "loss" in e and "train_loss" not in e]


@pytest.mark.subprocess
def test_debug_recipe_end_to_end(tmp_path):
    out = tmp_path / "debug"
    result = run([sys.executable, "finetune/train.py", "recipe=recipes/debug.yaml", f"train.output_dir={out}"])
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


@pytest.mark.subprocess
@pytest.mark.distributed
def test_two_ranks_through_accelerate_launch_match_one_process(tmp_path):
    """The same recipe on 1 and on 2 CPU ranks (real DDP on gloo): same per-step loss and final weights."""
    common = ["recipe=recipes/debug.yaml", "train.max_steps=3", "optim.name=sgd", "optim.lr=0.5"]
    one, two = tmp_path / "one", tmp_path / "two"
    run([sys.executable, "finetune/train.py", *common, f"train.output_dir={one}"])
    run(
        [
            *TWO_RANKS,
            "finetune/train.py",
            *common,
            f"train.output_dir={two}",
        ],
        env={"ACCELERATE_USE_CPU": "true"},
    )
    one_logs, two_logs = step_logs(one), step_logs(two)
    assert len(one_logs) == len(two_logs) == 3
    for a, b in zip(one_logs, two_logs):
        assert b["window_label_tokens"] == a["window_label_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)


@pytest.mark.subprocess
def test_quickstart_on_the_real_model_saves_a_model_that_reloads_and_generates(tmp_path):
    """SmolLM2-135M-Instruct from the GGUF, two short steps, W&B offline; then reload and chat."""
    out = tmp_path / "quick"
    result = run(
        [
            sys.executable,
            "finetune/train.py",
            "recipe=recipes/quickstart.yaml",
            f"train.output_dir={out}",
            "train.max_steps=2",
            "schedule.warmup_steps=1",
            "train.global_batch_size=2",
            "train.micro_batch_size=1",
            "data.max_length=64",
            "data.limit=32",
        ],
        env={"WANDB_MODE": "offline"},
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
