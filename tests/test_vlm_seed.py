"""recipes/vlm_seed.yaml: the numbers the issue fixes (global batch 1,024 from micro × accumulation × ranks, OneCycle,
lr 1e-4 at base batch 256 scaled linearly, packed captions of 10-100 tokens, what trains), and a short run of it
on CPU as `accelerate launch` runs it on one process (the data and steps made small in the test, not in the recipe)."""

import json

import pytest

from finetune.recipe import accumulation_steps, load_config
from finetune.recipe.run_plan import peak_lr
from tests.launch import call

SEED = "recipe=recipes/vlm_seed.yaml"


def test_the_seed_recipes_batch_schedule_and_lr():
    cfg = load_config([SEED])
    assert cfg.train.global_batch_size == 1024 and cfg.data.batching == "packed"
    assert cfg.train.micro_batch_size * accumulation_steps(cfg, 1) == 1024  # 16 × 64 on one process
    eight = load_config([SEED, "train.micro_batch_size=32"])  # the header's 8-GPU command
    assert 32 * accumulation_steps(eight, 8) * 8 == 1024
    assert (cfg.schedule.name, cfg.schedule.pct_start, cfg.schedule.div_factor) == ("onecycle", 0.1, 25)
    assert cfg.schedule.final_div_factor == 1e4
    assert peak_lr(cfg) == pytest.approx(1e-4 * 1024 / 256)
    assert cfg.model.freeze == ["model.vision_tower", "model.language_model"]
    assert not cfg.model.lora.enabled


@pytest.mark.slow  # slow: trains recipes/vlm_seed.yaml over the real SmolLM2-135M
@pytest.mark.e2e
def test_the_seed_recipe_trains_on_cpu(tmp_path, capfd):
    out = tmp_path / "out"
    small = ["data.limit=24", "train.micro_batch_size=4", "train.global_batch_size=8", "train.max_steps=2"]
    args = [SEED, *small, f"train.output_dir={out}", "log.wandb_mode=disabled"]
    result = call(capfd, args, ACCELERATE_USE_CPU="true")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "attention: packed_sdpa" in result.stdout
    state = json.loads((out / "trainer_state.json").read_text())
    logged = [e for e in state["log_history"] if "loss" in e and "train_loss" not in e]
    assert [e["step"] for e in logged] == [1, 2]
    assert all(e["window_label_tokens"] > 0 and 0 < e["loss"] < 20 for e in logged)
    # OneCycle: from peak / div_factor upwards (lr 1e-4 × 8 / 256 at this batch, linear scaling)
    assert logged[0]["learning_rate"] < 1e-4 * 8 / 256
