"""Research code subclasses Trainer and overrides hooks without super(); with TokenNormTrainer as the base it trains
exactly, or exactly as transformers.Trainer does with the same subclass and one warning, never silently different.

Each case runs the same subclass on both bases, on the same rows, with gradient accumulation 2."""

import copy
import logging

import pytest
import torch
from transformers import Trainer

from finetune import TokenNormTrainer
from finetune.testing.toy import (
    MeanLossLM,
    RecordingCollator,
    SnapshotCallback,
    ragged_rows,
    sgd_args,
    tiny_llama,
    train_recording,
)


def empty_window_rows() -> list[dict]:
    """Rows without a labelled token: every window is empty (the Trainer shuffles them)."""
    return [{"input_ids": r["input_ids"], "labels": [-100] * len(r["input_ids"])} for r in ragged_rows(8, seed=7)]


def own_optimizer(base):
    class OwnOptimizer(base):
        """Per-module learning rates: the usual reason research code builds its own optimizer (no super())."""

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                head = [p for n, p in self.model.named_parameters() if n.startswith("lm_head")]
                rest = [p for n, p in self.model.named_parameters() if not n.startswith("lm_head")]
                groups = [{"params": rest, "lr": 1e-2}, {"params": head, "lr": 1e-1}]
                self.optimizer = torch.optim.AdamW(groups, weight_decay=0.1)
            return self.optimizer

    return OwnOptimizer


def optimizer_state(trainer) -> dict:
    inner = trainer.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return {k: {n: v.clone() for n, v in s.items()} for k, s in enumerate(inner.state.values())}


@pytest.mark.parametrize("route", ["create_optimizer", "optimizers="])
def test_an_optimizer_built_outside_create_optimizer_gets_the_empty_window_veto(route, tmp_path, caplog):
    model = tiny_llama()
    before = SnapshotCallback.take(model)
    args = sgd_args(tmp_path, 2, 2, max_steps=1)  # the first window only: no labelled token
    if route == "create_optimizer":
        trainer_cls, extra = own_optimizer(TokenNormTrainer), {}
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        trainer_cls, extra = (
            TokenNormTrainer,
            {"optimizers": (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1))},
        )
    trainer = trainer_cls(
        model=model, args=args, train_dataset=empty_window_rows(), data_collator=RecordingCollator(), **extra
    )
    with caplog.at_level(logging.WARNING, logger="finetune.core.trainer"):
        trainer.train()
    after = SnapshotCallback.take(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # AdamW's decay would have moved every weight
    assert optimizer_state(trainer) == {}  # no moment, no step count: the optimizer state is untouched
    assert "the weights and the optimizer state are not updated" in caplog.text


def test_the_same_optimizer_moves_the_weights_under_trainer_on_that_window(tmp_path):
    """The veto is not vacuous: transformers.Trainer with the same subclass moves the weights on that window."""
    model = tiny_llama()
    before = SnapshotCallback.take(model)
    trainer = own_optimizer(Trainer)(
        model=model, args=sgd_args(tmp_path, 2, 2, max_steps=1), train_dataset=empty_window_rows(),
        data_collator=RecordingCollator(),
    )  # fmt: skip
    trainer.train()
    after = SnapshotCallback.take(model)
    assert not all(torch.equal(before[n], after[n]) for n in before)


def model_loss(base):
    class ModelLoss(base):
        """The most common research override: the model's own (per-batch mean) loss, no super()."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

    return ModelLoss


def research_loss(base):
    class ResearchLoss(base):
        """A loss written in compute_loss: the micro-batch's cross-entropy mean plus a small logit penalty."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            logits, labels = outputs["logits"][:, :-1], inputs["labels"][:, 1:]
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss = ce + 1e-3 * logits.pow(2).mean()
            return (loss, outputs) if return_outputs else loss

    return ResearchLoss


@pytest.mark.parametrize("subclass", [model_loss, research_loss], ids=["model_loss", "research_loss"])
def test_a_compute_loss_that_is_not_ours_trains_exactly_as_trainer_with_one_warning(subclass, tmp_path, caplog):
    """MeanLossLM's forward takes no **kwargs: Trainer divides its per-batch mean by the accumulation steps."""
    initial, rows = MeanLossLM(), ragged_rows(12, seed=3)
    with caplog.at_level(logging.WARNING, logger="finetune.core.trainer"):
        ours, _, ours_snaps = train_recording(
            subclass(TokenNormTrainer), copy.deepcopy(initial), rows, tmp_path / "a", 2, 2
        )
    stock, _, stock_snaps = train_recording(subclass(Trainer), copy.deepcopy(initial), rows, tmp_path / "b", 2, 2)
    assert len(ours_snaps) == len(stock_snaps) == 4  # 3 steps
    for step in range(1, 4):
        for name in ours_snaps[step]:
            torch.testing.assert_close(ours_snaps[step][name], stock_snaps[step][name], rtol=1e-6, atol=1e-7)
    moved = (ours_snaps[1]["head.weight"] - ours_snaps[0]["head.weight"]).abs().max()
    assert moved > 1e-3  # the steps did something (a K× update would differ by as much)
    warnings = [r for r in caplog.records if "did not compute" in r.getMessage()]
    assert len(warnings) == 1 and f"{subclass(TokenNormTrainer).__name__}.compute_loss" in warnings[0].getMessage()


def test_require_exact_turns_the_fallback_into_an_error(tmp_path):
    trainer = model_loss(TokenNormTrainer)(
        model=MeanLossLM(), args=sgd_args(tmp_path, 2, 2), train_dataset=ragged_rows(8, seed=3),
        data_collator=RecordingCollator(), require_exact=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="compute_loss.*require_exact=True: refused"):
        trainer.train()


def test_a_compute_loss_that_calls_super_stays_exact_and_silent(tmp_path, caplog):
    class Wrapped(TokenNormTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    from finetune.testing.toy import step_errors

    initial = tiny_llama()
    with caplog.at_level(logging.WARNING, logger="finetune.core.trainer"):
        trainer, windows, snaps = train_recording(
            Wrapped, copy.deepcopy(initial), ragged_rows(8, seed=2), tmp_path, 2, 2
        )
    assert max(error for error, _ in step_errors(initial, windows, snaps)) < 1e-5
    assert "did not compute" not in caplog.text and trainer.verdict.exact()


class SplicingLM(MeanLossLM):
    """A research VLM's shape: its forward inserts positions (image features) before the text and re-aligns the
    labels inside, so its logits are longer than the labels the collator made."""

    inserted = 3

    def __init__(self):
        super().__init__()
        self.image = torch.nn.Parameter(torch.randn(self.inserted, self.embed.embedding_dim) * 0.1)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = torch.cat([self.image.expand(input_ids.shape[0], -1, -1), self.embed(input_ids)], dim=1)
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        logits = self.head(torch.tanh(self.mix(x.cumsum(1) / steps)))
        out = {"logits": logits}
        if labels is not None:
            aligned = torch.cat([torch.full((labels.shape[0], self.inserted), -100), labels], dim=1)
            out["loss"] = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), aligned[:, 1:].flatten(), ignore_index=-100
            )
        return out


def test_a_model_that_re_aligns_its_labels_trains_exactly_as_trainer_with_one_warning(tmp_path, caplog):
    torch.manual_seed(0)
    initial, rows = SplicingLM(), ragged_rows(12, seed=5)
    with caplog.at_level(logging.WARNING, logger="finetune.core.trainer"):
        ours, _, ours_snaps = train_recording(TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path / "a", 2, 2)
        metrics = ours.evaluate(rows[:5])
    stock, _, stock_snaps = train_recording(Trainer, copy.deepcopy(initial), rows, tmp_path / "b", 2, 2)
    assert len(ours_snaps) == len(stock_snaps) == 4
    for step in range(1, 4):
        for name in ours_snaps[step]:
            torch.testing.assert_close(ours_snaps[step][name], stock_snaps[step][name], rtol=1e-6, atol=1e-7)
    assert stock.evaluate(rows[:5])["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-6)
    assert "eval_label_tokens" not in metrics  # nothing passed off as the exact token mean
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([w for w in warnings if "line up with the labels" in w]) == 1, warnings
    assert not [w for w in warnings if "did not compute" in w or "per-batch mean" in w], warnings


def test_require_exact_refuses_a_model_that_re_aligns_its_labels(tmp_path):
    trainer = TokenNormTrainer(
        model=SplicingLM(), args=sgd_args(tmp_path, 2, 2), train_dataset=ragged_rows(8, seed=5),
        data_collator=RecordingCollator(), require_exact=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"logits of shape \(2, \d+, \d+\).*require_exact=True: refused"):
        trainer.train()


@pytest.mark.distributed
def test_on_two_ranks_a_foreign_loss_equals_trainer_and_an_own_optimizer_keeps_the_veto(tmp_path):
    from tests.launch import forked_ranks
    from tests.workers import subclass_worker

    runs = {}
    for base, case in (("ours", "model_loss"), ("trainer", "model_loss"), ("ours", "own_optimizer")):
        out = str(tmp_path / f"{base}-{case}.pt")
        forked_ranks(subclass_worker.main, out, base, case)
        runs[base, case] = torch.load(out, weights_only=True)["snapshots"]
    ours, stock = runs["ours", "model_loss"], runs["trainer", "model_loss"]
    assert len(ours) == len(stock) == 3  # 12 rows over 2 ranks × 2 × 2: 2 steps
    for name in ours[-1]:
        torch.testing.assert_close(ours[-1][name], stock[-1][name], rtol=1e-6, atol=1e-7)
    assert (ours[-1]["head.weight"] - ours[0]["head.weight"]).abs().max() > 1e-3
    vetoed = runs["ours", "own_optimizer"]
    assert all(torch.equal(vetoed[0][n], vetoed[-1][n]) for n in vetoed[0])
