"""Exact evaluation: `eval_loss` is the token mean of the whole eval set (float64 brute force, one sequence at a time,
unpadded), whatever the eval batch size, the last short batch or the number of ranks; a resumed run's log history
equals the uninterrupted run's."""

import json

import pytest
from transformers import Trainer

from finetune import TokenNormTrainer
from finetune.testing.reference import reference_gradient
from finetune.testing.toy import RecordingCollator, ragged_rows, sgd_args, tiny_llama
from tests.dropin_models import KINDS, PadEachCollator
from tests.launch import forked_ranks
from tests.workers import eval_worker


def eval_rows(n: int = 23, seed: int = 9):
    return ragged_rows(n, seed=seed, min_len=4, max_len=48)


def target_count(rows, shift: bool) -> int:
    return sum(sum(t != -100 for t in r["labels"][1 if shift else 0 :]) for r in rows)


@pytest.mark.parametrize("name", ["causal_lm", "mean_loss_module", "masked_lm", "token_classification", "seq2seq"])
def test_eval_loss_is_the_token_mean_of_the_whole_set_at_every_eval_batch_size(name, tmp_path):
    kind = KINDS[name]
    model = kind.model()
    rows = eval_rows() if kind.shift else kind.rows(23, 9)
    _, reference = reference_gradient(model, rows, forward=kind.forward, shift=kind.shift)
    for batch in (1, 3, 7, 16):
        trainer = TokenNormTrainer(
            model=model,
            args=sgd_args(tmp_path, 1, 1, per_device_eval_batch_size=batch),
            eval_dataset=rows,
            data_collator=PadEachCollator(),
        )
        metrics = trainer.evaluate()
        assert abs(metrics["eval_loss"] - reference) / reference <= 1e-6, (batch, metrics["eval_loss"], reference)
        assert metrics["eval_label_tokens"] == target_count(rows, kind.shift)
        predicted = trainer.predict(rows).metrics
        assert abs(predicted["test_loss"] - reference) / reference <= 1e-6
        assert predicted["test_label_tokens"] == metrics["eval_label_tokens"]


def test_trainers_eval_loss_moves_with_the_eval_batch_size_where_ours_does_not(tmp_path):
    """The harness tells the difference: Trainer's eval_loss is a mean of per-batch means."""
    model, rows = tiny_llama(), eval_rows()
    _, reference = reference_gradient(model, rows)
    errors = []
    for batch in (3, 7, 16):
        stock = Trainer(
            model=model,
            args=sgd_args(tmp_path, 1, 1, per_device_eval_batch_size=batch),
            eval_dataset=rows,
            data_collator=RecordingCollator(),
        )
        errors.append(abs(stock.evaluate()["eval_loss"] - reference) / reference)
    assert max(errors) > 1e-5, errors  # ten times the bound ours holds (an untrained model's losses are all ~log V)


@pytest.mark.distributed
def test_eval_on_two_ranks_is_the_token_mean_of_the_whole_set(tmp_path):
    out = tmp_path / "eval.json"  # {eval batch size: [eval_loss, eval_label_tokens]}
    forked_ranks(eval_worker.main, "causal", str(out), str(tmp_path / "trainer"))
    metrics = json.loads(out.read_text())
    rows = eval_rows()  # 23 rows on 2 ranks in batches of 3: the last step repeats rows to fill its batches
    _, reference = reference_gradient(tiny_llama(), rows)
    for batch, (loss, tokens) in metrics.items():
        assert abs(loss - reference) / reference <= 1e-6, (batch, loss, reference)
        assert tokens == target_count(rows, shift=True)


def test_a_resumed_run_logs_the_same_history_as_the_uninterrupted_run(tmp_path):
    def trainer_in(out):
        args = sgd_args(out, 2, 2, max_steps=6)
        args.optim, args.learning_rate, args.save_strategy, args.save_steps = "adamw_torch", 1e-2, "steps", 3
        args.eval_strategy, args.eval_steps, args.per_device_eval_batch_size = "steps", 2, 3
        return TokenNormTrainer(
            model=tiny_llama(),
            args=args,
            train_dataset=ragged_rows(24, 4),
            eval_dataset=eval_rows(7),
            data_collator=RecordingCollator(),
        )

    whole = trainer_in(tmp_path / "whole")
    whole.train()
    resumed = trainer_in(tmp_path / "whole")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3"))

    def history(trainer):  # the keys transformers' own resume test skips: they measure time
        skip = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
        return [
            {k: v for k, v in e.items() if k not in skip and not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history
        ]

    assert history(resumed) == history(whole)
    steps = [e for e in whole.state.log_history if "grad_norm" in e]
    assert len(steps) == 6 and all("window_label_tokens" in e and "real_tokens_per_s" not in e for e in steps)
    assert [e["step"] for e in whole.state.log_history if "eval_loss" in e] == [2, 4, 6]
    assert all(e["eval_label_tokens"] > 0 for e in whole.state.log_history if "eval_loss" in e)


def test_timing_figures_reach_the_callbacks_but_not_the_saved_history(tmp_path):
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    seen = Seen()
    trainer = TokenNormTrainer(
        model=tiny_llama(),
        args=sgd_args(tmp_path, 2, 1, max_steps=2),
        callbacks=[seen],
        train_dataset=ragged_rows(4, 1),
        data_collator=RecordingCollator(),
    )
    trainer.train()
    step_logs = [e for e in seen.logs if "grad_norm" in e]
    assert len(step_logs) == 2 and all(e["real_tokens_per_s"] > 0 and e["peak_mem_mb"] > 0 for e in step_logs)
    saved = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert all("real_tokens_per_s" not in e and "peak_mem_mb" not in e for e in saved)
    assert [e["loss"] for e in saved] == [e["loss"] for e in step_logs]
