"""The LM head run chunk by chunk on the kept positions' hidden states: whether a model allows it, and the forward
that feeds it.

Logits are kept only where a target is (prompt and padding positions never reach the LM head), and where the model
returns its head's output unchanged the head and cross-entropy run in chunks on the hidden states, so [N, vocab]
logits never exist whole (finetune/core/loss.py `head_cross_entropy_sum`). The first training forward finds out
whether the model allows it; after that, the kept positions are an integer index made on the host from the
micro-batch's labels before it moves, where a boolean mask on the device would read its count back to the host in
the forward and again in the backward; a micro-batch whose mask only hides right padding without targets is run
without it (decided on the host as well: finetune/core/heads.py `ForwardTakes.unmasks_right_padding`).

Imports nothing of the package but `heads` and `loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.utils import logging

from finetune.core.heads import forward_through_one_row, head_passes_hidden_states, logits_of
from finetune.core.loss import head_cross_entropy_sum, kept_positions

logger = logging.get_logger(__name__)


class ChunkedHead:
    """`keeps_logits`: whether the model's forward keeps logits only where a target is (else nothing is chunked).
    `head`: None while not known (the first training forward finds out), False where the model's own (kept)
    logits are used, else the LM head whose weight the chunked loss multiplies by. `dtype`: the head's GEMMs' dtype
    under mixed precision (the loss runs outside the forward, where autocast is not active), else None."""

    def __init__(self, keeps_logits: bool, dtype: torch.dtype | None):
        self.keeps_logits = keeps_logits
        self.head: torch.nn.Linear | None | bool = None if keeps_logits else False
        self.dtype = dtype
        # (targets' shape, flat kept positions on the device) of the micro-batch being trained, taken by its forward
        self._positions: tuple | None = None
        self._unmasked = False  # whether that forward leaves out the mask of its right padding (ForwardTakes)

    def in_use(self) -> bool:
        return isinstance(self.head, torch.nn.Module)

    def hold_positions(
        self,
        targets: torch.Tensor | None,
        pinned: bool,
        unmasked: bool,
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Before a training micro-batch: its kept positions from its targets while they are on the host (copied
        without blocking, pinned where the batch is), once the chunked head is in use, and whether its forward leaves
        out its attention mask; None lets them go."""
        self._positions, self._unmasked = None, unmasked
        if targets is None or not self.in_use() or targets.device.type != "cpu":
            return
        index = kept_positions(targets)
        if pinned:
            index = index.pin_memory()
        self._positions = targets.shape, to_device(index)

    def forward(self, model, forward: dict, targets: torch.Tensor, find_head: Callable[[], torch.nn.Linear | None]):
        """(outputs, the kept positions' hidden states, the flat positions they were taken from where made on the
        host, else None) of a training forward whose `forward` keeps logits where a target is; (outputs, None, None)
        where the model's own logits are used."""
        if self._unmasked:  # decided on the host for this micro-batch, taken once
            self._unmasked = False
            del forward["attention_mask"]
        if self.head is None:
            if not forward["logits_to_keep"].any():
                return model(**forward), None, None
            return (*self._find(model, forward, find_head()), None)
        positions, self._positions = self._positions, None  # this micro-batch's, taken once
        if positions is None or positions[0] != targets.shape:
            with head_passes_hidden_states(self.head):
                outputs = model(**forward)
            return outputs, logits_of(outputs), None
        del forward["logits_to_keep"]  # every position's hidden state, then the host-made index: no mask read back
        with head_passes_hidden_states(self.head):
            outputs = model(**forward)
        hidden = logits_of(outputs)
        if hidden is None or hidden.shape[:-1] != targets.shape:
            shape = None if hidden is None else tuple(hidden.shape)
            raise ValueError(
                f"{type(model).__name__} returned hidden states {shape} for targets {tuple(targets.shape)}"
            )
        return outputs, hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions[1]), positions[1]

    def loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor, smoothing: float, index: torch.Tensor | None):
        """(summed loss, label tokens) of the kept positions' hidden states through the head, chunk by chunk."""
        return head_cross_entropy_sum(hidden, self.head.weight, self.head.bias, targets, smoothing, self.dtype, index)

    def _find(self, model, forward: dict, head: torch.nn.Linear | None):
        """The first training forward feeds the LM head one row of the kept hidden states (so no [tokens × vocab]
        logits are made) and keeps all of them for the chunked loss, if the model returns the head's output
        unchanged. A model that changes it after the head makes this micro-batch's forward run again, once."""
        if head is None:
            self.head = False
            return model(**forward), None
        outputs, hidden = forward_through_one_row(model, forward, head)
        if hidden is not None:
            self.head = head
            return outputs, hidden
        self.head = False
        logger.warning(
            f"TokenNormTrainer: {type(model).__name__} changes its logits after the LM head; its own logits "
            "are used (this first micro-batch ran its forward twice)"
        )
        return model(**forward), None
