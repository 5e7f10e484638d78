"""`eval_token_accuracy`: the share of every labelled position of the whole eval set whose argmax is its label, the
same at every eval batch size, against a float64 brute force (one sequence at a time, unpadded); for named sets, the
whole is every set's positions together."""

import copy

import torch

from finetune import TokenNormTrainer
from finetune.core import token_mean
from finetune.testing.toy import RecordingCollator, ragged_rows, sgd_args, tiny_llama


def brute_force_accuracy(model, rows) -> tuple[int, int]:
    """(hits, labelled positions) over the rows, each alone, unpadded, in float64."""
    reference = copy.deepcopy(model).double().eval()
    hits = count = 0
    with torch.no_grad():
        for row in rows:
            logits = reference(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            keep = labels != -100
            hits += int((logits[keep].argmax(-1) == labels[keep]).sum())
            count += int(keep.sum())
    return hits, count


def test_token_accuracy_is_the_whole_sets_argmax_share_at_every_eval_batch_size(tmp_path):
    model, rows = tiny_llama(), ragged_rows(23, seed=9, min_len=4, max_len=48)
    # a little training, so the argmax is not a coin toss: some positions right, most wrong
    TokenNormTrainer(
        model=model,
        args=sgd_args(tmp_path, 4, 1, max_steps=30),
        train_dataset=rows,
        data_collator=RecordingCollator(),
    ).train()
    hits, count = brute_force_accuracy(model, rows)
    assert 0 < hits < count
    for batch in (1, 3, 7, 16):
        metrics = TokenNormTrainer(
            model=model,
            args=sgd_args(tmp_path, 1, 1, per_device_eval_batch_size=batch),
            eval_dataset=rows,
            data_collator=RecordingCollator(),
        ).evaluate()
        assert metrics["eval_label_tokens"] == count
        assert round(metrics["eval_token_accuracy"] * count) == hits, (batch, metrics["eval_token_accuracy"], hits)


def test_named_sets_combine_into_the_token_mean_and_accuracy_of_all_their_positions():
    sets = {"eval_a_loss": 2.0, "eval_a_label_tokens": 30, "eval_a_token_accuracy": 0.5}
    sets |= {"eval_b_loss": 4.0, "eval_b_label_tokens": 10, "eval_b_token_accuracy": 0.1}
    whole = token_mean.combined_metrics(sets, ["a", "b"], "eval")
    assert whole == {"eval_loss": 2.5, "eval_label_tokens": 40, "eval_token_accuracy": 0.4}
    del sets["eval_b_token_accuracy"]  # a set without predictions seen: no accuracy for the whole
    assert "eval_token_accuracy" not in token_mean.combined_metrics(sets, ["a", "b"], "eval")
