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
