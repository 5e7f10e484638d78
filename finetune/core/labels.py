"""The label convention shared by the data side and the loss: `labels` is a row's own token ids, unshifted, with
IGNORE_INDEX wherever a position has no target; position t predicts labels[t + 1]. Imports no torch."""

from __future__ import annotations

from collections.abc import Sequence

IGNORE_INDEX = -100  # the label of a position without a target (transformers' and torch's cross-entropy default)


def target_count(labels: Sequence[int]) -> int:
    """Targets of one row after the causal shift: labels[1:] that are not IGNORE_INDEX."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)
