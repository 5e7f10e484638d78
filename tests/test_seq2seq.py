"""TokenNormSeq2SeqTrainer against Seq2SeqTrainer itself (same generations, same metric inputs) and against the float64
token mean (eval_loss at every eval batch size, on two ranks); a composed subclass says its eval loss is not exact."""

import json
import logging

import numpy as np
import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, Seq2SeqTrainer

from finetune import TokenNormSeq2SeqTrainer, TokenNormTrainer
from finetune.testing.reference import reference_gradient
from finetune.testing.toy import VOCAB
from tests.dropin_models import (
    MetricInputs,
    PadEachCollator,
    decoder_logits_alone,
    generating_args,
    seq2seq_rows,
    tiny_t5,
)
from tests.launch import forked_ranks
from tests.workers import eval_worker


def tiny_bart(seed: int = 0):
    torch.manual_seed(seed)
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return BartForConditionalGeneration(config)


MODELS = {"t5": tiny_t5, "bart": tiny_bart}


@pytest.mark.parametrize("batch", [1, 3, 7])  # a test per eval batch size: the model is rebuilt from its seed
@pytest.mark.parametrize("name", MODELS)
def test_generations_equal_seq2seq_trainers_and_eval_loss_is_the_token_mean(name, batch, tmp_path):
    model, rows = MODELS[name](), seq2seq_rows(23, seed=9)
    _, reference = reference_gradient(model, rows, forward=decoder_logits_alone, shift=False)
    tokens = sum(len(r["labels"]) for r in rows)
    theirs, ours = MetricInputs(), MetricInputs()
    stock = Seq2SeqTrainer(
        model=model,
        args=generating_args(tmp_path, batch),
        eval_dataset=rows,
        data_collator=PadEachCollator(),
        compute_metrics=theirs,
    )
    exact = TokenNormSeq2SeqTrainer(
        model=model,
        args=generating_args(tmp_path, batch),
        eval_dataset=rows,
        data_collator=PadEachCollator(),
        compute_metrics=ours,
    )
    stock_metrics, metrics = stock.evaluate(), exact.evaluate()
    np.testing.assert_array_equal(ours.seen[0][0], theirs.seen[0][0])  # the generated ids
    np.testing.assert_array_equal(ours.seen[0][1], theirs.seen[0][1])  # the labels, padded alike
    assert metrics["eval_generated_tokens"] == stock_metrics["eval_generated_tokens"]
    assert abs(metrics["eval_loss"] - reference) / reference <= 1e-6, (batch, metrics["eval_loss"], reference)
    assert metrics["eval_label_tokens"] == tokens
    predicted = exact.predict(rows, max_new_tokens=3)  # gen_kwargs reach generate as in Seq2SeqTrainer
    np.testing.assert_array_equal(predicted.predictions, stock.predict(rows, max_new_tokens=3).predictions)
    assert abs(predicted.metrics["test_loss"] - reference) / reference <= 1e-6


def test_one_generate_and_one_forward_per_eval_batch(tmp_path):
    model, rows = tiny_t5(), seq2seq_rows(9, seed=4)
    generates, forwards = [], []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    original = model.generate
    model.generate = lambda *a, **k: generates.append(1) or original(*a, **k)
    trainer = TokenNormSeq2SeqTrainer(
        model=model,
        args=generating_args(tmp_path, 3),
        eval_dataset=rows,
        data_collator=PadEachCollator(),
        compute_metrics=MetricInputs(),
    )
    trainer.evaluate()
    decoding_steps = len(forwards) - len(generates)  # generate's own forwards, then one loss forward per batch
    assert len(generates) == 3
    baseline = []
    model.generate = original
    stock = Seq2SeqTrainer(
        model=model,
        args=generating_args(tmp_path, 3),
        eval_dataset=rows,
        data_collator=PadEachCollator(),
        compute_metrics=MetricInputs(),
    )
    forwards.clear()
    stock.evaluate()
    baseline = len(forwards)
    assert decoding_steps + len(generates) == baseline  # no forward beyond Seq2SeqTrainer's own


def test_a_composed_seq2seq_trainer_says_its_eval_loss_is_not_exact(tmp_path, caplog):
    class Composed(TokenNormTrainer, Seq2SeqTrainer):
        pass

    model, rows = tiny_t5(), seq2seq_rows(23, seed=9)
    trainer = Composed(
        model=model,
        args=generating_args(tmp_path, 3),
        eval_dataset=rows,
        data_collator=PadEachCollator(),
        compute_metrics=MetricInputs(),
    )
    with caplog.at_level(logging.WARNING):
        metrics = trainer.evaluate()
    assert "not the exact token mean" in caplog.text and "TokenNormSeq2SeqTrainer" in caplog.text
    assert "eval_label_tokens" not in metrics  # nothing passed off as exact


@pytest.mark.distributed
def test_generating_eval_on_two_ranks_is_the_token_mean_of_the_whole_set(tmp_path):
    out = tmp_path / "eval.json"  # {eval batch size: [eval_loss, eval_label_tokens, generations equal to stock]}
    forked_ranks(eval_worker.main, "seq2seq", str(out), str(tmp_path / "trainer"))
    metrics = json.loads(out.read_text())
    rows = seq2seq_rows(23, seed=9)
    _, reference = reference_gradient(tiny_t5(), rows, forward=decoder_logits_alone, shift=False)
    for batch, (loss, tokens, same_generations) in metrics.items():
        # the rows repeated to fill the last batches count once (Seq2SeqTrainer's predictions keep them, as ours)
        assert abs(loss - reference) / reference <= 1e-6, (batch, loss, reference)
        assert tokens == sum(len(r["labels"]) for r in rows)
        assert same_generations
