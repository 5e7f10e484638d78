"""Sample-level losses (sequence classification, regression, multi-label, multiple choice) normalized like tokens: the
window's summed per-item loss ÷ the window's items, exact for uneven micro-batches and a partial last window against
a float64 brute force (one item at a time, unpadded); the eval loss the whole set's item mean; equal to Trainer on one
batch, where Trainer is exact."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import BertForMultipleChoice, BertForSequenceClassification, Trainer

from finetune import TokenNormTrainer
from finetune.testing.reference import relative_error
from finetune.testing.toy import VOCAB, SnapshotCallback, model_at, sgd_args
from tests.dropin_models import tiny_bert


def rows(n, problem, seed=0, choices=3):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 20))]
        if problem == "multiple_choice":
            ids = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(choices)]
            out.append({"input_ids": ids, "labels": rng.randrange(choices)})
        elif problem == "regression":
            out.append({"input_ids": ids, "labels": rng.uniform(-2, 2)})
        elif problem == "multi_label":
            out.append({"input_ids": ids, "labels": [float(rng.random() < 0.5) for _ in range(3)]})
        else:
            out.append({"input_ids": ids, "labels": rng.randrange(3)})
    return out


class ItemCollator:
    """Right-pads token rows (or each choice) with an attention mask; records the items of every micro-batch."""

    def __init__(self):
        self.batches = []

    def __call__(self, items):
        self.batches.append([dict(i) for i in items])
        choices = isinstance(items[0]["input_ids"][0], list)
        seqs = [c for i in items for c in i["input_ids"]] if choices else [i["input_ids"] for i in items]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        if choices:
            ids, mask = ids.view(len(items), -1, width), mask.view(len(items), -1, width)
        labels = torch.tensor([i["labels"] for i in items])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def model_for(problem):
    if problem == "multiple_choice":
        return tiny_bert(BertForMultipleChoice)
    labels = {"regression": 1, "multi_label": 3, "single_label": 3}[problem]
    extra = {"problem_type": "multi_label_classification"} if problem == "multi_label" else {}
    return tiny_bert(BertForSequenceClassification, num_labels=labels, **extra)


def item_loss(logits, label, problem):
    """One item's loss, float64, written out: its mean is what transformers' per-batch loss means."""
    if problem == "regression":
        return [(logits.reshape(()) - float(label)) ** 2]
    if problem == "multi_label":
        target = torch.tensor(label, dtype=torch.float64)
        return list(F.binary_cross_entropy_with_logits(logits.reshape(-1), target, reduction="none"))
    return [-torch.log_softmax(logits.reshape(-1), dim=-1)[int(label)]]


def reference(model, items, problem):
    """(float64 gradient of the mean per-value loss over the items, that mean), one item at a time, unpadded."""
    ref = copy.deepcopy(model).double().eval()
    ref.zero_grad(set_to_none=True)
    losses = []
    for item in items:
        if problem == "multiple_choice":  # each choice scored alone, unpadded: [1, 1, T] → one score
            logits = torch.cat([ref(input_ids=torch.tensor(c)[None, None]).logits[0] for c in item["input_ids"]])
        else:
            logits = ref(input_ids=torch.tensor(item["input_ids"])[None]).logits[0]
        losses += item_loss(logits, item["labels"], problem)
    mean = torch.stack(losses).mean()
    mean.backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}, float(mean.detach())


PROBLEMS = ["single_label", "regression", "multi_label", "multiple_choice"]


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("micro,accumulation,n", [(4, 3, 10), (3, 2, 11)], ids=["uneven", "partial-last-window"])
def test_applied_gradient_is_the_window_item_mean(problem, micro, accumulation, n, tmp_path):
    initial, data = model_for(problem), rows(n, problem, seed=5)
    collator, snapshots = ItemCollator(), SnapshotCallback()
    trainer = TokenNormTrainer(
        model=copy.deepcopy(initial),
        args=sgd_args(tmp_path, micro, accumulation),
        train_dataset=data,
        data_collator=collator,
        callbacks=[snapshots],
    )
    assert trainer.loss_kind == "sample"
    trainer.train()
    snaps = snapshots.snapshots
    windows = [sum(collator.batches[i : i + accumulation], []) for i in range(0, len(collator.batches), accumulation)]
    assert len(windows) == len(snaps) - 1 >= 1
    for k, window in enumerate(windows):
        grads, _ = reference(model_at(initial, snaps[k]), window, problem)
        applied = {name: snaps[k][name] - snaps[k + 1][name] for name in grads}
        assert relative_error(applied, grads) <= 1e-5, (k, relative_error(applied, grads))


@pytest.mark.parametrize("problem", PROBLEMS)
def test_eval_loss_is_the_item_mean_of_the_whole_set_and_trainers_on_one_batch(problem, tmp_path):
    model, data = model_for(problem), rows(23, problem, seed=9)
    _, expected = reference(model, data, problem)
    for batch in (1, 3, 7):
        args = sgd_args(tmp_path, 1, 1, per_device_eval_batch_size=batch)
        metrics = TokenNormTrainer(model=model, args=args, eval_dataset=data, data_collator=ItemCollator()).evaluate()
        assert abs(metrics["eval_loss"] - expected) / expected <= 1e-6, (batch, metrics["eval_loss"], expected)
    args = sgd_args(tmp_path, 1, 1, per_device_eval_batch_size=23)  # one batch: Trainer's mean is the item mean
    ours = TokenNormTrainer(model=model, args=args, eval_dataset=data, data_collator=ItemCollator()).evaluate()
    theirs = Trainer(model=model, args=args, eval_dataset=data, data_collator=ItemCollator()).evaluate()
    assert abs(ours["eval_loss"] - theirs["eval_loss"]) <= 1e-6 * theirs["eval_loss"]


def test_trainers_mean_of_micro_batch_means_is_not_the_window_mean(tmp_path):
    """The harness tells the difference: Trainer under uneven micro-batches averages means."""
    initial, data = model_for("single_label"), rows(10, "single_label", seed=5)
    collator, snapshots = ItemCollator(), SnapshotCallback()
    Trainer(
        model=copy.deepcopy(initial),
        args=sgd_args(tmp_path, 4, 3),
        train_dataset=data,
        data_collator=collator,
        callbacks=[snapshots],
    ).train()
    grads, _ = reference(model_at(initial, snapshots.snapshots[0]), sum(collator.batches[:3], []), "single_label")
    applied = {n: snapshots.snapshots[0][n] - snapshots.snapshots[1][n] for n in grads}
    assert relative_error(applied, grads) > 1e-2
