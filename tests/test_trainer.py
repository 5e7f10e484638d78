"""TokenNormTrainer applies exactly the token-mean gradient of each window (float64 brute force, one sequence at a
time).

With SGD, lr 1, no momentum or decay, the parameter change of a step is minus the gradient the trainer applied, so
every step of a run is checked against `reference_gradient` over the rows that window really held.
"""

import copy

import pytest
import torch
from transformers import Trainer

from finetune import TokenNormTrainer
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import (
    MeanLossLM,
    RecordingCollator,
    SnapshotCallback,
    ragged_rows,
    sgd_args,
    step_errors,
    tiny_llama,
    tiny_qwen_vl,
    train_recording,
)

MODELS = {"llama": tiny_llama, "qwen2_5_vl": tiny_qwen_vl, "mean_loss_module": MeanLossLM}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize(
    "micro,accumulation,rows",
    [(8, 1, 16), (1, 8, 16), (4, 3, 10), (2, 4, 10)],
    ids=["micro8-acc1", "micro1-acc8", "uneven-micro-batches", "partial-final-window"],
)
def test_applied_gradient_is_the_window_token_mean(model_name, micro, accumulation, rows, tmp_path):
    initial = MODELS[model_name]()
    data = ragged_rows(rows, seed=rows + micro)
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), data, tmp_path, micro, accumulation
    )
    # every row was used once, in windows of `accumulation` micro-batches (the last may be shorter)
    assert sorted(len(r["input_ids"]) for w in windows for r in w) == sorted(len(r["input_ids"]) for r in data)
    logged = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    assert len(logged) == len(windows)
    for (error, ref_loss), entry, window in zip(step_errors(initial, windows, snapshots), logged, windows):
        assert error <= 1e-5, f"applied gradient off by {error:.2e}"
        assert entry["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert entry["window_label_tokens"] == sum(sum(t != -100 for t in r["labels"][1:]) for r in window)


@pytest.mark.parametrize("model_name", ["qwen2_5_vl", "mean_loss_module"])
def test_stock_trainer_is_not_exact_on_these_models(model_name, tmp_path):
    """The same harness tells the difference: transformers.Trainer averages per-micro-batch means here."""
    initial = MODELS[model_name]()
    _, windows, snapshots = train_recording(Trainer, copy.deepcopy(initial), ragged_rows(10, seed=3), tmp_path, 4, 3)
    errors = [e for e, _ in step_errors(initial, windows, snapshots)]
    assert max(errors) > 1e-2


def test_clips_once_per_window_by_the_global_norm(tmp_path):
    initial = tiny_llama()
    data = ragged_rows(12, seed=5)
    grads, _ = reference_gradient(initial, data)
    norm = sum(float((g**2).sum()) for g in grads.values()) ** 0.5
    max_norm = 0.1 * norm
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), data, tmp_path, 3, 4, max_grad_norm=max_norm
    )
    assert len(windows) == 1
    applied = {n: snapshots[0][n] - snapshots[1][n] for n in grads}
    clipped = {n: g * (max_norm / norm) for n, g in grads.items()}
    assert relative_error(applied, clipped) <= 1e-5
    logged = next(e for e in trainer.state.log_history if "grad_norm" in e)
    assert logged["grad_norm"] == pytest.approx(norm, rel=1e-5)  # the pre-clip norm

    # Clipping each micro-batch's contribution instead would give a different update: the check can fail.
    per_micro = {n: torch.zeros_like(g) for n, g in grads.items()}
    total_targets = sum(sum(t != -100 for t in r["labels"][1:]) for r in data)
    for k in range(0, 12, 3):
        rows = windows[0][k : k + 3]
        g, _ = reference_gradient(initial, rows)
        share = sum(sum(t != -100 for t in r["labels"][1:]) for r in rows) / total_targets
        scaled = {n: v * share for n, v in g.items()}
        s_norm = sum(float((v**2).sum()) for v in scaled.values()) ** 0.5
        for n in per_micro:
            per_micro[n] += scaled[n] * min(1.0, max_norm / s_norm)
    assert relative_error(per_micro, clipped) > 1e-3


def test_window_without_labelled_tokens_makes_no_update(tmp_path):
    data = [{"input_ids": r["input_ids"], "labels": [-100] * len(r["input_ids"])} for r in ragged_rows(4, seed=7)]
    # the only target sits at position 0, which nothing predicts: still an empty window after the shift
    data[0]["labels"][0] = data[0]["input_ids"][0]
    model = tiny_llama()
    before = SnapshotCallback.take(model)
    args = sgd_args(tmp_path, 2, 2, max_grad_norm=1.0)
    args.optim = "adamw_torch"
    args.learning_rate = 1e-2
    trainer = TokenNormTrainer(model=model, args=args, train_dataset=data, data_collator=RecordingCollator())
    trainer.train()
    after = SnapshotCallback.take(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    entry = next(e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e)
    assert entry["loss"] == 0.0 and entry["window_label_tokens"] == 0
    assert torch.isfinite(torch.tensor(entry["grad_norm"]))


def test_model_without_logits_falls_back_to_trainer(tmp_path):
    class LossOnly(MeanLossLM):
        loss_type = None  # no declared loss kind: Trainer's own loss, unchanged

        def forward(self, input_ids, attention_mask=None, labels=None):
            out = super().forward(input_ids, attention_mask, labels)
            return {"loss": out["loss"]} if labels is not None else {"scores": out["logits"].sum(-1)}

    initial = LossOnly()
    data = ragged_rows(8, seed=11)
    ours, _, ours_snaps = train_recording(TokenNormTrainer, copy.deepcopy(initial), data, tmp_path / "a", 2, 2)
    stock, _, stock_snaps = train_recording(Trainer, copy.deepcopy(initial), data, tmp_path / "b", 2, 2)
    assert ours.loss_kind is None
    for name in ours_snaps[-1]:
        torch.testing.assert_close(ours_snaps[-1][name], stock_snaps[-1][name], rtol=1e-6, atol=1e-7)


def test_bf16_autocast_stays_within_bf16_tolerance_of_the_float64_window_gradient(tmp_path):
    initial = tiny_llama()
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(12, seed=12), tmp_path, 3, 2, bf16=True
    )
    assert trainer.accelerator.mixed_precision == "bf16"
    errors = [e for e, _ in step_errors(initial, windows, snapshots)]
    # bf16 matmuls carry ~3 significant digits; the fp32 path is ≤ 1e-5 (above). A wrong normalization is ≥ 1e-1.
    assert max(errors) <= 2e-2, errors


def test_fp16_unscales_before_clipping_and_skips_a_step_with_inf(tmp_path):
    initial = tiny_llama()
    data = ragged_rows(12, seed=13)
    grads, _ = reference_gradient(initial, data[:6])
    norm = sum(float((g**2).sum()) for g in grads.values()) ** 0.5

    class PoisonFirstStep(SnapshotCallback):
        """An inf gradient in the first window's backward only: GradScaler must skip that step and lower its scale."""

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                param = next(model.parameters())
                self.hook = param.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("inf")))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                self.hook.remove()
            super().on_step_end(args, state, control, model=model, **kwargs)

    collator, record = RecordingCollator(), PoisonFirstStep()
    trainer = TokenNormTrainer(
        model=copy.deepcopy(initial),
        args=sgd_args(tmp_path, 3, 2, max_grad_norm=0.5 * norm, fp16=True),
        train_dataset=data,
        data_collator=collator,
        callbacks=[record],
    )
    # Accelerate sets up fp16 (autocast + GradScaler) only on accelerators; give it its CUDA set-up on the CPU so
    # the real path runs: scaled backward, unscale inside clip_grad_norm_, GradScaler.step skipping an inf step.
    assert trainer.accelerator.scaler is None
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.accelerator.native_amp = True
    trainer.train()
    snapshots = record.snapshots
    assert all(torch.equal(snapshots[0][n], snapshots[1][n]) for n in snapshots[0]), "the inf step must not update"
    assert trainer.accelerator.scaler.get_scale() < 2.0**16
    # the second window: clipped from its unscaled fp16 gradient, within fp16 tolerance of the clipped reference
    window = sum(collator.batches[2:4], [])
    ref, _ = reference_gradient(initial, window)
    ref_norm = sum(float((g**2).sum()) for g in ref.values()) ** 0.5
    logged = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert logged[1]["grad_norm"] == pytest.approx(ref_norm, rel=2e-2)  # unscaled: not ×65536
    clipped = {n: g * min(1.0, 0.5 * norm / ref_norm) for n, g in ref.items()}
    applied = {n: snapshots[1][n] - snapshots[2][n] for n in ref}
    assert relative_error(applied, clipped) <= 2e-2
