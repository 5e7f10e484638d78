"""A stop request (SIGTERM/SIGINT, lifecycle.py) honoured at the next micro-batch, not at the window's end: the
unfinished window is discarded (its gradients zeroed; no optimizer or scheduler step) and the checkpoint holds the last
optimizer step, with the random number generators as the resumed run will meet that window again. A window of 128
micro-batches then stops in seconds, and the resume still equals the uninterrupted run bit for bit (docs/runs.md).

Where a resumed run restores the generators (transformers' `_run_epoch`): before the epoch's data iterator is made
when it starts at an epoch's first window, else right after it has fetched its first window. So the state to save is
the one at that same point of the uninterrupted run: `WindowStart` takes it at the start of each epoch and at the
first micro-batch of each window (microseconds per window; dropout in the window consumes the generators after it).

Several ranks stop at the same micro-batch: `StopAgreement` sums each rank's flag over a gloo (CPU) group of its own,
asynchronously, and every rank acts on the sum launched one micro-batch earlier: no device sync and no wait on the
fast path, the same collectives on every rank, and a stop at most two micro-batches after the signal.
"""

from __future__ import annotations

import torch

from finetune.training import checkpoints


class WindowStopped(Exception):
    """Raised at a micro-batch boundary (before its forward) once every rank agreed on a stop: the window is not
    applied. `RecipeTrainer._run_epoch` catches it and saves the last optimizer step."""


class StopAgreement:
    """Whether a stop was requested on any rank, asked at every micro-batch boundary.

    One process: its own flag. Several: each boundary waits for the previous boundary's one-int sum (launched a
    micro-batch ago, so it is done) and launches the next one; the verdict is that previous sum, the same on every
    rank. `group`: a gloo process group over all ranks (None: one process).
    """

    def __init__(self, stop_request, group=None):
        self.stop_request = stop_request
        self.group = group
        self._pending: tuple | None = None  # (work, tensor) of the sum in flight

    @classmethod
    def for_ranks(cls, stop_request, num_processes: int) -> StopAgreement:
        """Every rank calls this at the same point (new_group is collective over all ranks)."""
        group = None
        if num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            group = torch.distributed.new_group(backend="gloo")
        return cls(stop_request, group)

    def requested_here(self) -> bool:
        return self.stop_request is not None and self.stop_request.requested

    def agreed(self) -> bool:
        if self.group is None:
            return self.requested_here()
        previous = self.finish()
        flag = torch.tensor([int(self.requested_here())], dtype=torch.int32)
        self._pending = (torch.distributed.all_reduce(flag, group=self.group, async_op=True), flag)
        return previous

    def finish(self) -> bool:
        """Waits for the sum in flight (every rank launched the same ones); whether it says stop."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())


class WindowStart:
    """What a mid-window stop rewinds to: the generators where a resumed run restores them, the logged loss sum and
    FLOs before the window. `epoch_began()` at each epoch's start (and after the Trainer restored the generators
    there), `window_opened()` when a window is fetched, `micro_batch(trainer)` before each micro-batch."""

    def __init__(self) -> None:
        self.epoch_rng: dict | None = None
        self.window_rng: dict | None = None
        self._opened = False
        self.micro_batches = 0  # begun in this window, counting the one about to run
        self.tr_loss: torch.Tensor | None = None
        self.flos = 0.0

    def epoch_began(self) -> None:
        self.epoch_rng = checkpoints.rng_state()

    def window_opened(self) -> None:
        self._opened = True

    def micro_batch(self, trainer) -> None:
        """At the window's first micro-batch (after a resumed run restored the generators there): its start."""
        self.micro_batches += 1
        if not self._opened:
            return
        self._opened, self.micro_batches = False, 1
        self.window_rng = checkpoints.rng_state()
        tr_loss = getattr(trainer, "_tr_loss", None)
        self.tr_loss = tr_loss.detach().clone() if isinstance(tr_loss, torch.Tensor) else None
        self.flos = trainer.current_flos

    def rewind(self, first_of_epoch: bool) -> None:
        """The generators as they were at the window's start (the epoch's, for its first window: a resumed run
        restores them before it makes the epoch's data iterator). The trainer takes back `tr_loss` and `flos`."""
        state = self.epoch_rng if first_of_epoch else self.window_rng
        if state is not None:
            checkpoints.set_rng_state(state)
