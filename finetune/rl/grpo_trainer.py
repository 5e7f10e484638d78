"""`TokenNormGRPOTrainer`: a drop-in `trl.GRPOTrainer` (TRL 1.16) whose every optimizer step is its own window's
objective, not a share of the generation batch's average (the rule per loss type: finetune/rl/grpo_window.py).

What it changes, and nothing else (generation, rewards, advantages, the per-token loss, metrics are TRL's code):

- **The window is generated before its first backward.** `get_batch_samples` keeps the window's micro-batches (each
  the prompts of a generation batch, as TRL's sampler repeats them); at the window's first micro-batch TRL's own
  `_prepare_inputs` runs for every micro-batch of the window in turn, at the step it would have run at, so the
  buffer is generated, reused `num_iterations` times and sliced exactly as TRL does it. Where `steps_per_generation`
  is smaller than the accumulation, a window spans generation batches and the later ones are generated earlier (with
  the same weights: no optimizer step lies between). Its loss-mask tokens are then counted and summed over the ranks:
  one gather per window.
- **Token-level loss types** (`dapo`, `bnpo`, `cispo`, `vespo`) divide each micro-batch's summed loss by that
  count (÷ processes, for DDP's mean): TRL's own normalizer is given the `num_items_in_batch` that makes it so.
  `bnpo` takes dapo's path (the same per-token loss). `grpo`, `sapo`, `luspo` and `dr_grpo` are TRL's, already the
  window's mean over its sequences (or TRL's constant).
- **The entropy bonus** is the window's token mean, not each micro-batch's mean ÷ accumulation.
- **An empty window** (no loss-mask token on any rank) makes no update, where AdamW would still move the weights.

What cannot be made exact trains exactly as `GRPOTrainer` does, with one warning: a loss type this trainer does not
know, the entropy bonus over the high-entropy tokens (`top_entropy_quantile` < 1: their count is only known at each
forward), a window with fewer loss tokens than accumulation ÷ steps_per_generation (TRL's clamp of its count). A
mixture of experts' router loss stays TRL's mean over the window's micro-batches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.utils import logging
from trl import GRPOTrainer

from finetune.core.step_verdict import StepGate
from finetune.rl.grpo_window import (
    bonus_shift,
    dapo_items,
    floors_the_count,
    loss_mask,
    loss_tokens,
    normalization_of,
)

logger = logging.get_logger(__name__)


@dataclass
class GenerationWindow:
    """One optimizer step's micro-batches: as the dataloader gave them, as TRL prepared them (generated, buffered,
    sliced), the `_step` of the first one and the window's loss-mask tokens over all ranks."""

    batches: list
    prepared: list | None = None
    first_step: int = 0
    tokens: int | None = None

    def prepared_at(self, step: int, batch):
        """The prepared micro-batch for TRL's `step`, if `batch` is the one this window holds there."""
        index = step - self.first_step
        if self.prepared is not None and 0 <= index < len(self.batches) and self.batches[index] is batch:
            return self.prepared[index]
        return None

    def holds(self, inputs) -> bool:
        return self.prepared is not None and any(inputs is p for p in self.prepared)


class TokenNormGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with exact per-window normalization (see the module docstring). Same constructor."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.normalization = normalization_of(self.loss_type)
        self.window: GenerationWindow | None = None
        self._entropies: torch.Tensor | None = None  # the loss forward's, for the window's entropy bonus
        self._floor_said = False
        self.step_gate = StepGate(self.updates_weights, self._say_why_not_updated)
        if self.normalization is None:
            logger.warning(
                f"TokenNormGRPOTrainer: loss_type={self.loss_type!r} is not one it normalizes per window (token "
                "level: dapo, bnpo, cispo, vespo; per sequence: grpo, sapo, luspo; dr_grpo): it trains exactly as "
                "GRPOTrainer does"
            )
        self.exact_bonus = self.args.top_entropy_quantile >= 1.0
        if self._entropy_bonus_enabled and not self.exact_bonus:
            logger.warning(
                f"TokenNormGRPOTrainer: the entropy bonus over the high-entropy tokens (top_entropy_quantile="
                f"{self.args.top_entropy_quantile}) is each micro-batch's mean ÷ accumulation, as GRPOTrainer has "
                "it: which tokens count is only known at each micro-batch's forward"
            )

    # ---- the window: generated and counted before its first backward ----

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.window = GenerationWindow(batch_samples) if self.normalization is not None else None
        if not self.is_deepspeed_enabled:  # DeepSpeed's engine steps inside the last backward: not gated
            self.step_gate.hook_onto(self.optimizer)
        return batch_samples, num_items_in_batch

    def _prepare_inputs(self, generation_batch):
        window = self.window
        if not self.model.training or window is None:
            return super()._prepare_inputs(generation_batch)
        if window.prepared is None:
            self._prefetch(window)
        prepared = window.prepared_at(self._step, generation_batch)
        return super()._prepare_inputs(generation_batch) if prepared is None else prepared

    def _prefetch(self, window: GenerationWindow) -> None:
        """TRL's `_prepare_inputs` for each micro-batch of the window at the step TRL would run it (generating where
        TRL generates), then the window's loss-mask tokens summed over all ranks."""
        first, prepared = self._step, []
        try:
            for offset, batch in enumerate(window.batches):
                self._step = first + offset
                prepared.append(super()._prepare_inputs(batch))
        finally:
            self._step = first
        local = loss_tokens(prepared).reshape(1)
        window.tokens = int(self.accelerator.gather(local).sum().item())  # the window's one host sync
        window.prepared, window.first_step = prepared, first

    # ---- the loss: TRL's, divided by the window's count ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        window = self.window
        if not self.model.training or window is None or not window.holds(inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        coefficient = self._bonus_coefficient()  # read before TRL's adaptive controller updates it in this call
        if self.normalization == "token":
            inputs = self._window_inputs(inputs, window.tokens)
        self._entropies = None
        try:
            with self._dapo_path():
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if coefficient and self.exact_bonus and self._entropies is not None:
                mask = loss_mask(inputs)
                shift = bonus_shift(
                    mask.sum(),
                    self.current_gradient_accumulation_steps,
                    window.tokens,
                    self.accelerator.num_processes,
                )
                loss = loss + coefficient * (self._entropies * mask).sum() * shift
        finally:
            self._entropies = None
        return loss

    def _window_inputs(self, inputs, window_tokens: int):
        """The micro-batch with the `num_items_in_batch` that makes TRL's token-level normalizer the window's count
        (a copy: TRL reuses its buffered micro-batches over iterations)."""
        steps, micro = self.args.steps_per_generation, self.current_gradient_accumulation_steps
        if floors_the_count(window_tokens, steps, micro) and not self._floor_said:
            self._floor_said = True
            logger.warning(
                f"TokenNormGRPOTrainer: a window of {window_tokens} loss tokens, fewer than accumulation {micro} ÷ "
                f"steps_per_generation {steps}: GRPOTrainer's floor of its count divides it, as GRPOTrainer does"
            )
        items = torch.tensor(dapo_items(window_tokens, steps, micro), device=inputs["completion_mask"].device)
        return {**inputs, "num_items_in_batch": items}

    @contextlib.contextmanager
    def _dapo_path(self):
        """bnpo's per-token loss is dapo's; only its normalizer differs, and here both are the window's count."""
        if self.loss_type != "bnpo":
            yield
            return
        self.loss_type = "dapo"
        try:
            yield
        finally:
            self.loss_type = "bnpo"

    def _bonus_coefficient(self) -> float:
        """The entropy bonus coefficient TRL applies to this micro-batch (its adaptive gate included), 0 without."""
        if not self._entropy_bonus_enabled:
            return 0.0
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return self.entropy_coef

    def _get_per_token_logps_and_entropies(self, model, *args, compute_entropy=False, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, *args, compute_entropy=compute_entropy, **kwargs)
        if compute_entropy and torch.is_grad_enabled():  # the loss forward's entropies, with their graph
            self._entropies = result[1]
        return result

    # ---- the optimizer step consults updates_weights() ----

    def updates_weights(self) -> bool:
        """Not for a window without a loss-mask token on any rank (its zero gradient would still move AdamW), unless
        a router loss gives it a gradient."""
        window = self.window
        return window is None or window.tokens is None or window.tokens > 0 or self.aux_loss_enabled

    def _say_why_not_updated(self) -> None:
        logger.warning(
            f"optimizer step {self.state.global_step + 1}: the window has no loss-mask token on any rank (every "
            "completion masked); the weights and the optimizer state are not updated for this step"
        )
