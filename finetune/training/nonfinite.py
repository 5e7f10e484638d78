"""A step's non-finite values (train.on_nonfinite): what the step's verdict is, the error that stops a run, and the
one host read of the step's figures that the verdict and the log share."""

from __future__ import annotations

import torch

from finetune.recipe import RecipeError


class NonFiniteError(RecipeError):
    """train.on_nonfinite=stop met a NaN/inf loss or gradient: one line naming the step, exit code 3 (not 2: the
    recipe loaded and training ran)."""

    exit_code = 3


def nonfinite_verdict(bad_grads: bool, bad_loss: bool, fp16: bool, on_nonfinite: str) -> tuple[bool, bool, bool]:
    """(veto the update, count it as skipped, stop) for one optimizer step with these non-finite flags.

    Under fp16 an overflowing gradient is the GradScaler's business: it skips the update itself and lowers its scale;
    that is counted like any skip but never stops the run.
    """
    bad = bad_grads or bad_loss
    scaler_overflow = fp16 and bad_grads and not bad_loss
    return bad_loss or (bad_grads and not fp16), bad, bad and on_nonfinite == "stop" and not scaler_overflow


def read_back(*values) -> list[float]:
    """Python floats of numbers and device scalars, with one host read for all the tensors among them (each `float()`
    of a device tensor waits for the device on its own)."""
    tensors = [v.detach().reshape(()).float() for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else ())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
