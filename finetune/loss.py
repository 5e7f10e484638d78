"""Summed next-token cross-entropy and the label-token count it is normalized by. Pure functions, no state.

The trainer divides the *sum* over a whole accumulation window (all data-parallel ranks) by the window's label-token
count, so both functions use exactly one mask: position t predicts labels[t + 1], and a target of -100 is ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Targets the loss sees after the causal shift: `labels[..., 1:] != -100` (int64 scalar)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropy over labelled positions in float32 or wider, their count).

    logits: [B, T, V] (any float dtype); labels: [B, T] with -100 where there is no target.
    Only labelled rows of the logits are upcast, so bf16/fp16 logits cost one float32 copy of the targets' rows,
    not of the whole [B, T, V] tensor.
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} as [B, T, V]/[B, T]")
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    picked = logits[:, :-1][mask]  # [N, V]: only the positions that have a target
    accumulate = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss_sum = F.cross_entropy(picked.to(accumulate), targets[mask], reduction="sum")
    return loss_sum, mask.sum()
