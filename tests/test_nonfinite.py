"""train.on_nonfinite: a NaN/inf loss or gradient at one step is skipped (no update, counted) or stops the run.

A NaN is injected into the loss, or an inf into one parameter's gradient, during optimizer step 2 only.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.recipe import load_config
from finetune.training.nonfinite import nonfinite_verdict
from finetune.training.recipe_trainer import RecipeTrainer

COMMON = [
    "recipe=recipes/debug.yaml",
    "data.limit=16",
    "data.max_length=64",
    "train.max_steps=3",
    "train.save_steps=1",
    "log.wandb_mode=disabled",
]
BAD_STEP = 2


@pytest.fixture
def poison(monkeypatch):
    """poison("loss"): step 2's first micro-batch has a NaN loss; poison("grad"): an inf gradient, finite loss."""

    def arm(kind: str):
        compute_loss = RecipeTrainer.compute_loss

        def poisoned(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
            if self.state.global_step + 1 != BAD_STEP or getattr(self, "_poisoned", False) or not loss.requires_grad:
                return loss
            self._poisoned = True
            if kind == "loss":
                return loss * float("nan")
            weight = self.accelerator.unwrap_model(model).model.layers[0].mlp.up_proj.weight
            handle = weight.register_hook(lambda grad: (handle.remove(), grad * float("inf"))[1])
            return loss

        monkeypatch.setattr(RecipeTrainer, "compute_loss", poisoned)

    return arm


def step_logs(folder: Path) -> list[dict]:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [e for e in history if "loss" in e and "grad_norm" in e]


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_skip_makes_no_update_at_that_step_and_counts_it(kind, poison, tmp_path):
    from finetune.tools.train import train

    poison(kind)
    assert train(load_config([*COMMON, f"train.output_dir={tmp_path}", "train.on_nonfinite=skip"])) == 0
    logs = step_logs(tmp_path)
    assert [e["nonfinite_skipped"] for e in logs] == [0, 1, 1]
    assert torch.isfinite(torch.tensor(logs[2]["loss"])) and torch.isfinite(torch.tensor(logs[2]["grad_norm"]))
    if kind == "grad":
        assert logs[1]["grad_norm"] == float("inf") or logs[1]["grad_norm"] != logs[1]["grad_norm"]
    # Step 2 changed nothing: weights and optimizer moments after it are those after step 1, bit for bit.
    after_1, after_2 = (load_file(tmp_path / f"checkpoint-{k}" / "model.safetensors") for k in (1, 2))
    assert all(torch.equal(after_1[n], after_2[n]) for n in after_1)
    moments_1, moments_2 = (
        torch.load(tmp_path / f"checkpoint-{k}" / "optimizer.pt", weights_only=True)["state"] for k in (1, 2)
    )
    assert all(torch.equal(moments_1[i]["exp_avg"], moments_2[i]["exp_avg"]) for i in moments_1)
    final = load_file(tmp_path / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in final.values())
    assert not all(torch.equal(final[n], after_2[n]) for n in final)  # step 3 trained normally
    assert json.loads((tmp_path / "checkpoint-3" / "finetune_state.json").read_text())["nonfinite_skipped"] == 1


@pytest.mark.e2e
def test_stop_exits_3_with_one_line_naming_the_step_and_saves_nothing_new(poison, tmp_path, capsys):
    from finetune.tools.train import main

    poison("loss")
    code = main([*COMMON, f"train.output_dir={tmp_path}", "train.on_nonfinite=stop"])
    assert code == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: optimizer step {BAD_STEP}: the loss and the gradient norm are not finite")
    assert "train.on_nonfinite=skip" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no checkpoint-2, no final model


@pytest.mark.parametrize(
    "bad_grads, bad_loss, fp16, mode, expected",
    [
        (False, False, False, "stop", (False, False, False)),
        (True, False, False, "skip", (True, True, False)),
        (True, False, False, "stop", (True, True, True)),
        (False, True, False, "stop", (True, True, True)),
        # fp16: the GradScaler skips an overflowing step itself (and lowers its scale); counted, never a stop
        (True, False, True, "stop", (False, True, False)),
        (True, False, True, "skip", (False, True, False)),
        (True, True, True, "stop", (True, True, True)),  # a NaN loss is not an overflow
    ],
)
def test_nonfinite_verdict(bad_grads, bad_loss, fp16, mode, expected):
    assert nonfinite_verdict(bad_grads, bad_loss, fp16, mode) == expected
