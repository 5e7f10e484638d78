"""What a run shows: the offline W&B run read back, per-step throughput figures, MFU, the profiler, the summary."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import DataCollatorWithFlattening

from finetune.core.meter import batch_counts, flops_per_token, matmul_parameters
from finetune.testing.toy import ragged_rows, tiny_llama
from tests.launch import call
from tests.wandb_reader import read_run

STEP_KEYS = ["loss", "learning_rate", "grad_norm", "clip_factor", "window_label_tokens", "padding_efficiency"]
# measured, not reproducible: in W&B and on the console, not in trainer_state.json (a resume must reproduce that)
TIMING_KEYS = ["real_tokens_per_s", "computed_tokens_per_s", "samples_per_s", "peak_mem_mb", "mfu"]


def run_debug(capfd, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """finetune/train.py's main on the debug recipe, in this process; it must succeed."""
    result = call(capfd, ["recipe=recipes/debug.yaml", f"train.output_dir={out}", *overrides])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.e2e
def test_offline_wandb_run_holds_the_recipe_and_every_step_series(tmp_path, capfd):
    out = tmp_path / "run"
    # a peak of 1 TFLOP/s makes the MFU series exist on a CPU
    result = run_debug(capfd, out, "log.wandb_mode=offline", "log.peak_tflops=1.0", "log.run_name=debug-wandb")
    state = json.loads((out / "trainer_state.json").read_text())
    steps = [e for e in state["log_history"] if "grad_norm" in e]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]

    run_files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, "one offline run per job, under train.output_dir"
    history, config, summary = read_run(run_files[0])
    rows = [h for h in history if "train/loss" in h]
    assert [r["train/global_step"] for r in rows] == [1, 2, 3, 4]
    for row, entry in zip(rows, steps):
        for key in STEP_KEYS:
            assert row[f"train/{key}"] == pytest.approx(entry[key], rel=1e-9), key
        for key in TIMING_KEYS:
            assert row[f"train/{key}"] > 0 and key not in entry, key
        assert 0 < row["train/padding_efficiency"] <= 1 and 0 < row["train/clip_factor"] <= 1
        assert row["train/real_tokens_per_s"] <= row["train/computed_tokens_per_s"]
    # the exact per-step token counts: every target of the run, summed over its windows
    assert sum(e["window_label_tokens"] for e in steps) == summary["label_tokens"]
    assert config["_run_name"] == "debug-wandb"
    assert config["recipe"]["model"]["config_overrides"]["hidden_size"] == 64
    assert config["recipe"]["train"]["global_batch_size"] == 8 and config["recipe"]["recipe"] == "recipes/debug.yaml"
    assert summary["final_loss"] == pytest.approx(steps[-1]["loss"]) and summary["optimizer_steps"] == 4
    assert f"wandb sync {run_files[0].parent}" in result.stdout
    # the console: one line per step and the end-of-run table
    assert "step 4/4  loss " in result.stderr + result.stdout
    for row in ("optimizer steps", "real tokens", "wall time", "tokens/s", "final loss", "peak memory", "model"):
        assert f"  {row} " in result.stdout


@pytest.mark.e2e
def test_mfu_is_real_tokens_times_model_flops_over_peak(tmp_path, capfd):
    out = tmp_path / "mfu"
    run_debug(capfd, out, "log.peak_tflops=0.5", "train.max_steps=2", "log.wandb_mode=offline")
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    steps = [h for h in read_run(run_file)[0] if "train/loss" in h]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(steps) == 2
    for row in steps:
        expected = row["train/real_tokens_per_s"] * flops_per_token(model, row["train/mean_sequence_tokens"]) / 0.5e12
        assert row["train/mfu"] == pytest.approx(expected, rel=1e-9)


def test_flops_per_token_counts_every_matmul_weight():
    model = tiny_llama(tie=True)
    c = model.config
    per_layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * (c.hidden_size // 2)  # q, o; k, v (2 kv heads)
    per_layer += 3 * c.hidden_size * c.intermediate_size
    expected_params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size  # + the (tied) head
    assert matmul_parameters(model) == expected_params
    assert flops_per_token(model, 100) == 6 * expected_params + 12 * c.num_hidden_layers * c.hidden_size * 100


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_through():
    """Fused expert weights are no nn.Linear: a token multiplies by top-k of the E experts' matrices, and MFU counts
    that share, with attention and the head in full; written out from the config. The router's E × hidden weight (no
    nn.Linear either) is left out, as the embeddings are: a few thousandths of a layer's matmuls at real sizes."""
    from transformers import Qwen3MoeForCausalLM

    from tests.test_router_balance import moe_config

    c = moe_config(vocab_size=100, router_loss=False)  # 2 layers of 4 experts, 2 per token
    model = Qwen3MoeForCausalLM(c)
    attention = 2 * c.hidden_size * 4 * 8 + 2 * c.hidden_size * 2 * 8  # q, o; k, v
    routed = c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size  # gate, up, down of 2 of the 4
    expected = c.num_hidden_layers * (attention + routed) + c.vocab_size * c.hidden_size
    assert matmul_parameters(model) == expected


def test_a_mixture_that_names_its_experts_otherwise_counts_them_alike():
    """DeepSeek-V3 keeps its expert count in config.n_routed_experts (its model has no num_experts): its routed share
    is counted all the same, over its mixture-of-experts layers (layer 0 stays dense: first_k_dense_replace)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from finetune.testing.families import FAMILIES

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    c = DeepseekV3Config(vocab_size=100, num_key_value_heads=4, **small, **FAMILIES["deepseek_v3"])  # 4 experts, 2 each
    model = DeepseekV3ForCausalLM(c)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    routed = (c.num_hidden_layers - c.first_k_dense_replace) * c.num_experts_per_tok * 3 * 32 * c.moe_intermediate_size
    assert matmul_parameters(model) == linear + routed


def test_batch_counts_for_padded_and_packed_batches():
    rows = ragged_rows(5, seed=3)
    packed = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)([dict(r) for r in rows])
    total = sum(len(r["input_ids"]) for r in rows)
    targets = sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)
    assert batch_counts(packed) == [targets, total, total, 5]
    width = max(len(r["input_ids"]) for r in rows)
    padded = {
        "input_ids": torch.zeros(5, width, dtype=torch.long),
        "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows]),
        "labels": torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows]),
    }
    assert batch_counts(padded) == [targets, total, 5 * width, 5]


@pytest.mark.e2e
def test_profile_steps_write_a_table_and_a_trace(tmp_path, capfd):
    out = tmp_path / "prof"
    result = run_debug(capfd, out, "train.profile_steps=[2,3]")
    table = (out / "profile_steps_2-3.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    trace = json.loads((out / "profile_steps_2-3.trace.json").read_text())
    assert trace["traceEvents"]
    assert "profile of steps 2-3" in result.stdout


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_start_says_trainable_of_total_parameters_in_one_line_as_the_model_counts_them(lora, tmp_path, capsys):
    from finetune.assemble import build
    from finetune.recipe import load_config

    argv = ["recipe=recipes/debug.yaml", "data.limit=16", f"train.output_dir={tmp_path}"]
    trainer = build(load_config([*argv, *(["model.lora.enabled=true", "model.lora.r=16"] if lora else [])]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("parameters:")]
    assert len(lines) == 1, lines
    params = list(trainer.model.parameters())
    trainable, total = sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
    assert lines[0] == f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f} %)"
    assert (trainable < total / 10) if lora else (trainable == total)
