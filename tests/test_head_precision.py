"""The chunked LM head under bf16/fp16: one forward per micro-batch whatever wraps the forward, no [tokens × vocab]
logits, and exact against float64 within the precision's own error.

The bound: a bf16 (fp16) forward rounds every GEMM input to 8 (11) significant bits, so no bf16 run is closer to the
float64 gradient than that arithmetic itself allows. The floor is measured, not assumed: the independent brute force
(one sequence at a time, unpadded) run with its forward under the same autocast. Ours may not be worse than that floor
by more than 25 %, nor worse than 2 units of roundoff (2^-7 for bf16, 2^-10 for fp16) in absolute terms.
"""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from finetune import TokenNormTrainer
from finetune.core.loss import head_cross_entropy_sum, next_token_targets
from finetune.testing.toy import ragged_rows, step_errors, tiny_llama, train_recording
from tests.floors import autocast_brute_force_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def test_bf16_training_makes_one_forward_per_micro_batch_and_never_full_logits(tmp_path, caplog):
    """accelerate wraps the forward in convert_outputs_to_fp32 under bf16: the head's output comes back as a float32
    copy, which must still count as unchanged (it used to cost a second forward and full logits)."""
    model = tiny_llama()
    vocab, forwards, head_outputs = model.config.vocab_size, [], []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    model.lm_head.register_forward_hook(lambda module, args, output: head_outputs.append(tuple(output.shape)))
    with caplog.at_level(logging.WARNING):
        trainer, windows, _ = train_recording(
            TokenNormTrainer, model, ragged_rows(12, seed=8), tmp_path, 2, 3, bf16=True
        )
    assert trainer.accelerator.native_amp and trainer.accelerator.mixed_precision == "bf16"
    assert trainer.chunked_head.head is trainer.model.lm_head
    assert len(forwards) == 2 * 3  # two optimizer steps of three micro-batches, one forward each
    assert [s for s in head_outputs if s[-1] == vocab] == [(1, vocab)]  # the first forward's one-row probe only
    assert "changes its logits" not in caplog.text


def test_bf16_training_is_exact_within_bf16s_own_error(tmp_path):
    initial = tiny_llama()
    _, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(12, seed=8), tmp_path, 2, 3, bf16=True
    )
    for k, (error, _) in enumerate(step_errors(initial, windows, snapshots)):
        floor = autocast_brute_force_error(initial, snapshots[k], windows[k], torch.bfloat16)
        assert error <= 1.25 * floor and error <= 2 * ROUNDOFF["bf16"], (error, floor)


def head_case(seed=0, rows=3, length=40, hidden=48, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(rows, length, hidden, generator=g)
    weight = torch.randn(vocab, hidden, generator=g) * hidden**-0.5
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    labels[:, :7] = -100  # a prompt
    labels[1, 30:] = -100  # padding
    return states, weight, labels


def float64_head(states, weight, targets):
    """Sum of CE over kept positions in float64 (from the given, possibly rounded, states and weight) and grads."""
    states, weight = states.double().requires_grad_(), weight.double().requires_grad_()
    keep = targets != -100
    loss = F.cross_entropy(states[keep] @ weight.t(), targets[keep], reduction="sum")
    loss.backward()
    return loss.detach(), states.grad, weight.grad


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_chunked_head_in_low_precision_is_as_exact_as_autocast_logits(precision, monkeypatch):
    """GEMMs in the autocast dtype, accumulation in float32: per quantity, no worse than what autocast does to the
    model's own head (full logits in bf16/fp16, cross-entropy in float32), both against float64."""
    import finetune.core.loss as loss_module

    monkeypatch.setattr(loss_module, "head_chunk_rows", lambda vocab, device=None: 16)  # several chunks, one ragged
    dtype = DTYPES[precision]
    states, weight, labels = head_case()
    targets = next_token_targets(labels)
    keep = targets != -100
    expected = float64_head(states, weight, targets)

    ours_states, ours_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, count = head_cross_entropy_sum(ours_states[keep], ours_weight, None, targets, compute_dtype=dtype)
    loss.backward()
    assert loss.dtype == torch.float32 and int(count) == int(keep.sum())

    auto_states, auto_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        logits = auto_states[keep] @ auto_weight.t()
    auto = F.cross_entropy(logits.float(), targets[keep], reduction="sum")
    auto.backward()

    def errors(value, states_grad, weight_grad):
        return [
            abs(float(value) - float(expected[0])) / abs(float(expected[0])),
            float((states_grad.double() - expected[1]).norm() / expected[1].norm()),
            float((weight_grad.double() - expected[2]).norm() / expected[2].norm()),
        ]

    ours = errors(loss, ours_states.grad, ours_weight.grad)
    theirs = errors(auto, auto_states.grad, auto_weight.grad)
    for mine, autocast in zip(ours, theirs):
        assert mine <= 1.25 * autocast + 1e-6, (ours, theirs)
        assert mine <= 2 * ROUNDOFF[precision], ours


def test_fp16_chunked_head_under_grad_scaler_unscales_to_the_float64_gradient():
    """fp16 as a GPU run does it, on the CPU: autocast fp16, GradScaler's scaled backward, unscale; then a forced inf
    makes the scaler skip the step."""
    states, weight, labels = head_case(seed=3)
    targets = next_token_targets(labels)
    keep = targets != -100
    _, _, expected_weight_grad = float64_head(states.half().float(), weight.half().float(), targets)
    head = torch.nn.Parameter(weight.clone())
    optimizer = torch.optim.SGD([head], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    loss, _ = head_cross_entropy_sum(states[keep], head, None, targets, compute_dtype=torch.float16)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    error = float((head.grad.double() - expected_weight_grad).norm() / expected_weight_grad.norm())
    assert error <= 2 * ROUNDOFF["fp16"], error
    before = head.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(head.detach(), before) and scaler.get_scale() == 2.0**16

    optimizer.zero_grad()
    poisoned = states.clone()
    poisoned[0, 10, 0] = float("inf")
    loss, _ = head_cross_entropy_sum(poisoned[keep], head, None, targets, compute_dtype=torch.float16)
    scaler.scale(loss).backward()
    before = head.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(head.detach(), before) and scaler.get_scale() == 2.0**15  # skipped, scale halved


def test_inside_autocast_the_head_takes_autocasts_dtype_and_keeps_float32_sums():
    """The planner's trials and users' own loops call the loss inside autocast: the result is the explicit bf16 one
    (the float32 log-sum-exp and sums are not autocast down), bit for bit."""
    states, weight, labels = head_case(seed=5)
    targets = next_token_targets(labels)
    keep = targets != -100
    explicit, _ = head_cross_entropy_sum(states[keep], weight, None, targets, compute_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ambient, _ = head_cross_entropy_sum(states[keep], weight, None, targets)
    assert ambient.dtype == torch.float32 and torch.equal(ambient, explicit)
