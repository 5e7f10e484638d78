"""Summed next-token cross-entropy and the label-token count it is normalized by. Pure functions, no state.

The trainer divides the *sum* over a whole accumulation window (all data-parallel ranks) by the window's label-token
count, so every function here uses exactly one mask: position t predicts labels[t + 1], and a target of -100 is
ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Targets the loss sees after the causal shift: `labels[..., 1:] != -100` (int64 scalar)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def predicting_positions(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions whose next label is a target; the only logits the loss needs."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return keep


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Accumulate in float32 (float64 stays float64) whatever the logits' dtype: bf16/fp16 sums drift.
    accumulate = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(accumulate), targets, reduction="sum")


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropy over labelled positions, their count) from full logits.

    logits: [B, T, V] (any float dtype); labels: [B, T] with -100 where there is no target.
    Only the rows of the logits that have a target are upcast.
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} as [B, T, V]/[B, T]")
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    return _summed_cross_entropy(logits[:, :-1][mask], targets[mask]), mask.sum()


def kept_token_loss_sum(kept_logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sum from logits computed only at `predicting_positions(labels)` ([N, V], row-major order)."""
    targets = labels[:, 1:][labels[:, 1:] != IGNORE_INDEX]
    if kept_logits.dim() != 2 or kept_logits.shape[0] != targets.numel():
        raise ValueError(f"kept logits {tuple(kept_logits.shape)} do not match {targets.numel()} targets")
    return _summed_cross_entropy(kept_logits, targets), torch.tensor(targets.numel())


def head_chunk_rows(vocab_size: int, budget_elements: int = 1 << 24) -> int:
    """Rows of logits computed at once by the chunked head: about 64 MB of float32 logits per chunk."""
    return max(64, budget_elements // max(vocab_size, 1))


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T + bias, target_i), never holding more than one chunk of [rows, vocab] logits.

    The gradients are computed chunk by chunk during the forward (softmax - one_hot is all the backward needs), so
    neither the logits nor their softmax are kept for the backward: memory O(tokens × hidden + vocab × hidden)
    instead of O(tokens × vocab). The same idea as fused linear-cross-entropy kernels, in plain torch.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows: int):
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # as _summed_cross_entropy
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=accumulate, device=bias.device)
        loss_sum = torch.zeros((), dtype=accumulate, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = hidden[start : start + chunk_rows]
            logits = rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())
            logits = logits.to(accumulate)
            target = targets[start : start + chunk_rows]
            log_norm = torch.logsumexp(logits, dim=-1)
            loss_sum += (log_norm - logits.gather(1, target[:, None]).squeeze(1)).sum()
            # d(sum CE)/d logits = softmax - one_hot, computed in place over the chunk's logits
            grad_logits = logits.sub_(log_norm[:, None]).exp_()
            grad_logits[torch.arange(target.shape[0], device=target.device), target] -= 1.0
            grad_hidden[start : start + chunk_rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight.addmm_(grad_logits.t(), rows.to(accumulate))
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype),
                              None if grad_bias is None else grad_bias.to(bias.dtype))
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output):
        # Scaled in place: no second [vocab × hidden] buffer while the weight's gradient is accumulated (a second
        # backward through this graph would fail autograd's version check rather than see scaled values).
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        return (
            grad_hidden.mul_(grad_output.to(grad_hidden.dtype)),
            grad_weight.mul_(grad_output.to(grad_weight.dtype)) if ctx.needs_input_grad[1] else None,
            grad_bias.mul_(grad_output.to(grad_bias.dtype)) if grad_bias is not None and ctx.needs_input_grad[2] else None,
            None,
            None,
        )


def head_token_loss_sum(
    kept_hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss from hidden states at `predicting_positions(labels)` ([N, H], row-major) and the LM head's
    weight [V, H] (and bias), computed in chunks so that [N, V] logits never exist whole."""
    targets = labels[:, 1:][labels[:, 1:] != IGNORE_INDEX].to(kept_hidden.device)
    if kept_hidden.dim() != 2 or kept_hidden.shape[0] != targets.numel():
        raise ValueError(f"kept hidden states {tuple(kept_hidden.shape)} do not match {targets.numel()} targets")
    if targets.numel() == 0:  # keeps the graph (zero gradients) without an empty matmul
        return kept_hidden.sum() * 0.0, torch.tensor(0)
    chunk_rows = head_chunk_rows(weight.shape[0])
    return _ChunkedHeadCrossEntropy.apply(kept_hidden, weight, bias, targets, chunk_rows), torch.tensor(targets.numel())
