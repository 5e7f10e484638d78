"""What decides one optimizer step of `TokenNormTrainer`: the window's label tokens over all data-parallel ranks, and
whether each micro-batch's loss was this project's window share (the exact token mean) or a loss from elsewhere (a
subclass's own `compute_loss`), from which the step is either exact or exactly `transformers.Trainer`'s.

Imports nothing of the package but `token_mean`; the trainer owns one `StepVerdict` and consults it from its hooks.
"""

from __future__ import annotations

from finetune import token_mean


class StepVerdict:
    """One optimizer step's facts and the verdict drawn from them.

    - `open_window(count)` at the window's start (`None`: the window could not be counted);
    - `begin_micro_batch()` / `loss_is_ours()` around each micro-batch's loss: whether `compute_loss` divided it by the
      window's count (then nothing divides again), or it came from elsewhere (then `Trainer`'s own rule applies);
    - `updates_weights()` before the optimizer step.
    """

    def __init__(self) -> None:
        self.window_label_tokens: int | None = None
        self.foreign_losses = 0  # micro-batches of this window whose loss did not come from the window share
        self.micro_batch_loss_ours = False

    def open_window(self, window_label_tokens: int | None) -> None:
        self.window_label_tokens, self.foreign_losses = window_label_tokens, 0

    def begin_micro_batch(self) -> None:
        self.micro_batch_loss_ours = False

    def loss_is_ours(self) -> None:
        self.micro_batch_loss_ours = True

    def end_micro_batch(self) -> bool:
        """Whether this micro-batch's loss came from elsewhere (counted for the step's verdict)."""
        foreign = not self.micro_batch_loss_ours
        self.foreign_losses += foreign
        return foreign

    def exact(self) -> bool:
        """Whether every micro-batch of the window so far took the exact window share."""
        return self.foreign_losses == 0

    def updates_weights(self) -> bool:
        """Whether the step may change the weights. A window without a labelled token has a zero exact gradient: no
        update. A loss from elsewhere may have a gradient there (a regulariser, another objective): `Trainer` steps."""
        return not self.exact() or token_mean.updates_weights(self.window_label_tokens)
