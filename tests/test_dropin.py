"""TokenNormTrainer as a drop-in: every loss kind exact under accumulation (float64 brute force, one sequence at a
time, unpadded), the same loss as `transformers.Trainer` on one batch, compute_loss_func and label smoothing
honoured, Trainer's own behaviour for models it does not normalize, one forward per micro-batch, train() twice."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer

from finetune import TokenNormTrainer
from finetune.testing.toy import (
    RecordingCollator,
    SnapshotCallback,
    model_at,
    ragged_rows,
    sgd_args,
    step_errors,
    tiny_llama,
    tiny_qwen_vl,
    train_recording,
)
from tests.dropin_models import KINDS, FallbackModule, PadEachCollator


def args_with(out, micro, accumulation, **changes):
    """sgd_args with some of its own settings changed (learning rate, optimizer)."""
    args = sgd_args(out, micro, accumulation)
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def window_errors(initial, windows, snapshots, **reference) -> list[float]:
    return [error for error, _ in step_errors(initial, windows, snapshots, **reference)]


@pytest.mark.parametrize("name", ["gpt2", "token_classification", "masked_lm", "seq2seq"])
def test_each_loss_kind_is_exact_under_accumulation_and_equals_trainer_on_one_batch(name, tmp_path):
    kind = KINDS[name]
    initial, rows = kind.model(), kind.rows(10, 4)
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path / "a", 2, 3, collator=PadEachCollator()
    )
    assert trainer.loss_kind == kind.kind
    errors = window_errors(initial, windows, snapshots, forward=kind.forward, shift=kind.shift)
    assert max(errors) <= 1e-5, errors

    # one micro-batch, no accumulation: the batch's token mean, exactly what Trainer reports for these heads
    stock = Trainer(model=copy.deepcopy(initial), args=sgd_args(tmp_path / "b", 4, 1), data_collator=PadEachCollator())
    batch = PadEachCollator()(rows[:4])
    with torch.no_grad():
        ours = trainer.compute_loss(model_at(initial, snapshots[0]), dict(batch))
        theirs = stock.compute_loss(stock.model, dict(batch))
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_a_model_the_trainer_does_not_normalize_trains_exactly_as_trainer(tmp_path, caplog):
    initial, rows = FallbackModule(), ragged_rows(8, seed=11)
    ours, _, ours_snaps = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path / "a", 2, 2, collator=PadEachCollator()
    )
    stock, _, stock_snaps = train_recording(
        Trainer, copy.deepcopy(initial), rows, tmp_path / "b", 2, 2, collator=PadEachCollator()
    )
    assert ours.loss_kind is None
    assert "FallbackModule" in caplog.text and "Trainer's own loss" in caplog.text
    for name in ours_snaps[-1]:
        torch.testing.assert_close(ours_snaps[-1][name], stock_snaps[-1][name], rtol=0, atol=0)

    def steps(trainer):
        return [{k: v for k, v in e.items() if not k.startswith("train_")} for e in trainer.state.log_history]

    assert steps(ours) == steps(stock)


class Regression(nn.Module):
    """transformers' test style: no input_ids, a float target, (loss, prediction) out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Parameter(torch.randn(1)), nn.Parameter(torch.randn(1))

    def forward(self, input_x, labels=None):
        y = self.a * input_x + self.b
        return (y,) if labels is None else (F.mse_loss(y, labels), y)


def test_batches_without_input_ids_a_regression_model_as_trainer(tmp_path):
    data = [{"input_x": float(x), "labels": 2.0 * x + 3.0} for x in torch.linspace(-1, 1, 16).tolist()]
    results = []
    for cls in (TokenNormTrainer, Trainer):
        trainer = cls(
            model=Regression(),
            args=args_with(tmp_path / cls.__name__, 4, 2, learning_rate=0.1, per_device_eval_batch_size=5),
            train_dataset=data,
        )
        trainer.train()
        results.append(
            (
                [float(p) for p in trainer.model.parameters()],
                trainer.evaluate(data)["eval_loss"],
                [e.get("loss") for e in trainer.state.log_history],
            )
        )
    assert results[0] == results[1]
    assert results[0][0] != [float(p) for p in Regression().parameters()]  # it trained


def test_a_causal_lm_fed_inputs_embeds_without_input_ids_is_exact(tmp_path):
    initial = tiny_llama()
    config = initial.config
    table = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(3))

    class EmbedsCollator(RecordingCollator):
        def __call__(self, rows):
            batch = super().__call__(rows)
            return {"inputs_embeds": table[batch.pop("input_ids")], **batch}

    def forward(model, seq):
        embeds = table[torch.as_tensor(seq["input_ids"])].to(torch.float64).unsqueeze(0)
        return model(inputs_embeds=embeds).logits

    _, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(9, 2), tmp_path, 2, 2, collator=EmbedsCollator()
    )
    assert max(window_errors(initial, windows, snapshots, forward=forward)) <= 1e-5


def summed_cross_entropy(outputs, labels, num_items_in_batch):
    logits = outputs["logits"]
    total = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum")
    return total / num_items_in_batch


def test_compute_loss_func_gets_the_window_label_tokens_and_is_exact(tmp_path):
    initial = tiny_llama()
    _, windows, snapshots = train_recording(
        TokenNormTrainer,
        copy.deepcopy(initial),
        ragged_rows(10, 6),
        tmp_path,
        2,
        3,
        collator=PadEachCollator(),
        trainer_kwargs={"compute_loss_func": summed_cross_entropy},
    )
    assert max(window_errors(initial, windows, snapshots)) <= 1e-5


def test_compute_loss_func_result_is_the_loss_as_with_trainer(tmp_path):
    def constant(outputs, labels, num_items_in_batch):
        return outputs["logits"].sum() * 0.0 + 123.0

    logged = []
    for cls in (TokenNormTrainer, Trainer):
        trainer = cls(
            model=tiny_llama(),
            args=sgd_args(tmp_path / cls.__name__, 2, 1, max_steps=2),
            train_dataset=ragged_rows(4, 1),
            data_collator=RecordingCollator(),
            compute_loss_func=constant,
        )
        trainer.train()
        logged.append([e["loss"] for e in trainer.state.log_history if "grad_norm" in e])
    assert logged[0] == logged[1] == [123.0, 123.0]


def test_compute_loss_func_returning_a_non_scalar_is_one_clear_error(tmp_path):
    def per_token(outputs, labels, num_items_in_batch):
        return outputs["logits"].logsumexp(-1)

    trainer = TokenNormTrainer(
        model=tiny_llama(),
        args=sgd_args(tmp_path, 2, 1),
        train_dataset=ragged_rows(4, 1),
        data_collator=RecordingCollator(),
        compute_loss_func=per_token,
    )
    with pytest.raises(ValueError, match=r"compute_loss_func must return a scalar loss tensor .* returned \(2, \d+\)"):
        trainer.train()


@pytest.mark.parametrize("name", ["causal_lm", "masked_lm", "token_classification"])
def test_label_smoothing_is_exact_under_accumulation_and_equals_trainer_on_one_batch(name, tmp_path):
    kind, smoothing = KINDS[name], 0.1
    initial, rows = kind.model(), kind.rows(10, 7)
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer,
        copy.deepcopy(initial),
        rows,
        tmp_path / "a",
        2,
        3,
        collator=PadEachCollator(),
        label_smoothing_factor=smoothing,
    )
    errors = window_errors(
        initial, windows, snapshots, forward=kind.forward, shift=kind.shift, label_smoothing=smoothing
    )
    assert max(errors) <= 1e-5, errors
    stock = Trainer(model=copy.deepcopy(initial), args=sgd_args(tmp_path / "b", 4, 1, label_smoothing_factor=smoothing))
    batch = PadEachCollator()(rows[:4])
    with torch.no_grad():
        ours = trainer.compute_loss(model_at(initial, snapshots[0]), dict(batch))
        theirs = stock.compute_loss(stock.model, dict(batch))
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(lambda module, args: setattr(self, "calls", self.calls + 1))


@pytest.mark.parametrize("name", ["causal_lm", "qwen2_5_vl", "mean_loss_module", "fallback", "masked_lm", "seq2seq"])
def test_one_forward_per_micro_batch_in_training_and_evaluation(name, tmp_path):
    kind = KINDS["causal_lm" if name in ("qwen2_5_vl", "fallback") else name]
    model = {"qwen2_5_vl": tiny_qwen_vl, "fallback": FallbackModule}.get(name, kind.model)()
    rows = kind.rows(8, 5)
    counter = ForwardCounter(model)
    trainer = TokenNormTrainer(
        model=model,
        args=sgd_args(tmp_path, 2, 2, per_device_eval_batch_size=3),
        train_dataset=rows,
        eval_dataset=rows[:7],
        data_collator=PadEachCollator(),
    )
    trainer.train()
    assert counter.calls == 4  # 8 rows, micro-batches of 2
    trainer.evaluate()
    assert counter.calls == 4 + 3  # 7 rows, eval batches of 3


def test_train_can_be_called_twice_and_an_empty_window_still_makes_no_update(tmp_path):
    empty = [{"input_ids": r["input_ids"], "labels": [-100] * len(r["input_ids"])} for r in ragged_rows(4, seed=7)]
    model = tiny_llama()
    args = args_with(tmp_path, 2, 2, max_grad_norm=1.0, optim="adamw_torch", learning_rate=1e-2)
    trainer = TokenNormTrainer(model=model, args=args, train_dataset=empty, data_collator=RecordingCollator())
    before = SnapshotCallback.take(model)
    trainer.train()
    trainer.train()  # the optimizer is built again and wrapped by a new LR scheduler
    after = SnapshotCallback.take(model)
    assert all(torch.equal(before[n], after[n]) for n in before)

    trainer.train_dataset = ragged_rows(4, seed=7)
    trainer.train()
    moved = SnapshotCallback.take(model)
    assert any(not torch.equal(after[n], moved[n]) for n in after)
