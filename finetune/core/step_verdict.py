"""What decides one optimizer step of `TokenNormTrainer`: the window's label tokens over all data-parallel ranks,
whether each micro-batch's loss was this project's window share (the exact token mean) or a loss from elsewhere (a
subclass's own `compute_loss`), from which the step is either exact or exactly `transformers.Trainer`'s, and whether
its values were finite (the recipe trainer's verdict on non-finite losses and gradients, agreed by all ranks).

Imports nothing of the package but `token_mean`; the trainer owns one `StepVerdict` and consults it from its hooks,
and one `StepGate`, the hook through which its optimizer steps consult `updates_weights()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from finetune.core import token_mean


class StepVerdict:
    """One optimizer step's facts and the verdict drawn from them.

    - `open_window(count, batches)` at the window's start (`None`: the window could not be counted);
    - `begin_micro_batch()` / `loss_is_ours()` around each micro-batch's loss: whether `compute_loss` divided it by the
      window's count (then nothing divides again), or it came from elsewhere (then `Trainer`'s own rule applies);
    - `note_loss(loss)` after each backward, `take_window_finite()` once per step: the window's losses finite;
    - `nonfinite`: the step's verdict on non-finite values, set once all ranks agree (RecipeTrainer);
    - `updates_weights()` before the optimizer step.
    """

    def __init__(self) -> None:
        self.window_label_tokens: int | None = None
        self.window_micro_batches = 1
        self.window_batches: list | None = None  # the window's micro-batches, as this trainer counted them
        self.trainers_count = None  # Trainer's own count of them, made where its loss takes over inside the window
        self.window_routing: torch.Tensor | None = None  # moe_balance="window": the window's expert counts and rows
        self.foreign_losses = 0  # micro-batches of this window whose loss did not come from the window share
        self.micro_batch_loss_ours = False
        self.window_finite: bool | torch.Tensor = True  # a device tensor while the window runs: no host sync
        self.nonfinite = False  # this step's verdict: a non-finite loss or gradient, no update

    def open_window(self, window_label_tokens: int | None, batches: list | None = None) -> None:
        self.window_label_tokens, self.foreign_losses = window_label_tokens, 0
        # on this rank: what a per-micro-batch term is averaged over
        self.window_micro_batches = len(batches) if batches else 1
        self.window_batches, self.trainers_count = batches, None

    def begin_micro_batch(self) -> None:
        self.micro_batch_loss_ours = False

    def loss_is_ours(self) -> None:
        self.micro_batch_loss_ours = True

    def end_micro_batch(self) -> bool:
        """Whether this micro-batch's loss came from elsewhere (counted for the step's verdict)."""
        foreign = not self.micro_batch_loss_ours
        self.foreign_losses += foreign
        return foreign

    def note_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Folds a micro-batch's loss into the window's finite flag (on the device); whether this one is finite."""
        finite = torch.isfinite(loss).all()
        self.window_finite = finite & self.window_finite
        return finite

    def take_window_finite(self) -> bool | torch.Tensor:
        """The window's finite flag, and a fresh one for the next window."""
        finite, self.window_finite = self.window_finite, True
        return finite

    def exact(self) -> bool:
        """Whether every micro-batch of the window so far took the exact window share."""
        return self.foreign_losses == 0

    def updates_weights(self) -> bool:
        """Whether the step may change the weights. Not with a non-finite verdict. A window without a labelled token
        has a zero exact gradient: no update. A loss from elsewhere may have a gradient there (a regulariser, another
        objective): `Trainer` steps."""
        if self.nonfinite:
            return False
        return not self.exact() or token_mean.updates_weights(self.window_label_tokens)


class StepGate:
    """The veto on an optimizer step: a step pre-hook on the torch optimizer inside whatever wraps it (accelerate's
    wrapper, a subclass's own optimizer, the constructor's optimizers=), hooked once; a step that `updates_weights()`
    refuses finds no gradient, and every torch optimizer leaves such parameters (and their state) alone."""

    def __init__(self, updates_weights: Callable[[], bool], vetoed: Callable[[], None]):
        self._updates_weights = updates_weights
        self._vetoed = vetoed  # says why, where the step's owner has something to say
        self._gated: torch.optim.Optimizer | None = None

    def hook_onto(self, optimizer) -> None:
        inner = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        if isinstance(inner, torch.optim.Optimizer) and inner is not self._gated:
            inner.register_step_pre_hook(self._before_step)
            self._gated = inner

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self._updates_weights():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
            self._vetoed()
