"""The loss pieces against a float64 brute force, and the chunked LM head inside the trainer."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from finetune import TokenNormTrainer
from finetune.core import loss as loss_module
from finetune.core.loss import count_label_tokens, head_cross_entropy_sum, next_token_targets, predicting_positions
from finetune.testing.reference import relative_error
from finetune.testing.toy import ragged_rows, step_errors, tiny_llama, train_recording


def brute_force_sum(hidden, weight, bias, labels):
    """sum over every (row, t) with labels[row, t + 1] != -100 of -log softmax(hidden[row, t] W^T + b)[target]."""
    total = torch.zeros((), dtype=torch.float64)
    for row in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[row, t + 1])
            if target == -100:
                continue
            logits = hidden[row, t] @ weight.t() + (0 if bias is None else bias)
            total = total - torch.log_softmax(logits, dim=-1)[target]
    return total


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_head_loss_and_gradients_equal_the_brute_force(with_bias, monkeypatch):
    torch.manual_seed(0)
    hidden = torch.randn(3, 9, 16, dtype=torch.float64)
    weight = torch.randn(37, 16, dtype=torch.float64) * 0.3
    bias = torch.randn(37, dtype=torch.float64) if with_bias else None
    labels = torch.randint(0, 37, (3, 9))
    labels[0, :4] = -100
    labels[2, 5:] = -100
    # several chunks and a ragged last one
    monkeypatch.setattr(loss_module, "head_chunk_rows", lambda vocab, device=None: 4)

    params = [p.requires_grad_() for p in (hidden, weight, bias) if p is not None]
    expected = brute_force_sum(hidden, weight, bias, labels)
    expected_grads = torch.autograd.grad(expected * 1.7, params)

    kept = hidden[predicting_positions(labels)]
    total, count = head_cross_entropy_sum(kept, weight, bias, next_token_targets(labels))
    assert int(count) == int(count_label_tokens(labels)) == 17
    grads = torch.autograd.grad(total * 1.7, params)  # an upstream scale reaches every gradient
    assert float(total.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_chunked_head_in_float32_is_within_1e5_of_float64():
    torch.manual_seed(1)
    hidden, weight = torch.randn(2, 40, 24), torch.randn(500, 24) * 0.2
    labels = torch.randint(0, 500, (2, 40))
    total, _ = head_cross_entropy_sum(
        hidden[predicting_positions(labels)].requires_grad_(), weight, None, next_token_targets(labels)
    )
    expected = brute_force_sum(hidden.double(), weight.double(), None, labels)
    assert abs(float(total) - float(expected)) / float(expected) <= 1e-5


class ScaledHeadLlama(LlamaForCausalLM):
    """Scales the logits after the head (as soft-capping models do): the chunked head must not be used."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-embeddings"])
def test_trainer_uses_the_chunked_head_and_stays_exact(tie, tmp_path):
    initial = tiny_llama(tie=tie)
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(12, seed=8), tmp_path, 2, 3
    )
    assert trainer.chunked_head.head is trainer.model.lm_head
    for error, _ in step_errors(initial, windows, snapshots):
        assert error <= 1e-5


def test_a_model_that_changes_logits_after_the_head_gets_its_logits_used(tmp_path):
    base = tiny_llama()
    initial = ScaledHeadLlama(base.config)
    initial.load_state_dict(base.state_dict())
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(12, seed=8), tmp_path, 2, 3
    )
    assert trainer.chunked_head.head is False

    def scaled(model, seq):  # the reference sees the same scaled logits the model returns
        return model(input_ids=torch.as_tensor(seq["input_ids"]).unsqueeze(0)).logits

    from finetune.testing.reference import reference_gradient
    from finetune.testing.toy import model_at

    for k, window in enumerate(windows):
        grads, _ = reference_gradient(model_at(initial, snapshots[k]), window, forward=scaled)
        applied = {n: snapshots[k][n] - snapshots[k + 1][n] for n in grads}
        assert relative_error(applied, grads) <= 1e-5


def test_no_step_makes_logits_for_every_kept_position(tmp_path):
    """The probe feeds the head one row; training forwards pass hidden states through it: the head never makes
    [tokens × vocab] logits (the memory a large micro-batch's first step would otherwise need)."""
    model = tiny_llama()
    vocab = model.config.vocab_size
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    train_recording(TokenNormTrainer, model, ragged_rows(8, seed=2), tmp_path, 2, 2)
    logits_shapes = [s for s in shapes if s[-1] == vocab]
    assert logits_shapes == [(1, vocab)], logits_shapes
    assert len(shapes) == 4  # one forward per micro-batch: the first feeds the head one row, then hidden states
