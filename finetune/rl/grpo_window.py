"""The window rule of `TokenNormGRPOTrainer`, pure (torch only): how each of TRL 1.16's GRPO loss types is normalized
per optimizer step, and the numbers with which TRL's own `_compute_loss` then divides by the window's count.

TRL generates once per `steps_per_generation` micro-batches and reuses the buffer `num_iterations` times. Its
`dapo`, `cispo` and `vespo` divide every micro-batch by the *generation batch's* loss-mask tokens (all ranks) ÷
processes × accumulation ÷ steps_per_generation: the average window's count, not this window's; `bnpo` by each
micro-batch's own tokens ÷ accumulation; the entropy bonus is each micro-batch's token mean ÷ accumulation. Here:

- **token-level** (`TOKEN_LEVEL`): the window's summed per-token loss (KL term included) ÷ the window's loss-mask
  tokens over all data-parallel ranks, counted before the window's first backward with every mask TRL puts on the
  loss mask (padding after EOS, truncated completions where masked, tool output). TRL's normalizer
  `num_items ÷ processes × micro_batches ÷ steps_per_generation` becomes that count when its `num_items_in_batch` is
  `dapo_items(...)`; `bnpo` takes dapo's path, whose per-token loss is the same.
- **per sequence** (`PER_SEQUENCE`) and **constant** (`CONSTANT`): TRL's micro-batch mean ÷ accumulation is already
  the mean over the window's sequences (TRL splits a generation batch into equal micro-batches), and dr_grpo's
  constant is TRL's: unchanged.
- **the entropy bonus**: the window's token mean (`bonus_shift` turns TRL's micro-batch mean into it).

Multiplicative token weights (the off-policy mask, the high-entropy mask, vLLM's importance ratios) stay weights of
the sum, as in TRL; they do not change the count.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

TOKEN_LEVEL = ("dapo", "bnpo", "cispo", "vespo")
PER_SEQUENCE = ("grpo", "sapo", "luspo")
CONSTANT = ("dr_grpo",)


def normalization_of(loss_type: str) -> str | None:
    """ "token", "sequence" or "constant"; None for a loss type this rule does not know (TRL's own then trains)."""
    for name, kinds in (("token", TOKEN_LEVEL), ("sequence", PER_SEQUENCE), ("constant", CONSTANT)):
        if loss_type in kinds:
            return name
    return None


def loss_mask(inputs: Mapping) -> torch.Tensor:
    """The mask TRL's loss sums over: completion tokens (padding after EOS and masked truncations already 0) that the
    model generated (tool output is 0 in `tool_mask`)."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def loss_tokens(micro_batches: list[Mapping]) -> torch.Tensor:
    """The loss-mask tokens of these micro-batches (one rank's), a device scalar: no host sync."""
    return torch.stack([loss_mask(m).sum() for m in micro_batches]).sum()


def dapo_items(window_tokens: int, steps_per_generation: int, micro_batches: int) -> float:
    """The `num_items_in_batch` with which TRL's token-level normalizer, num_items ÷ processes × micro_batches ÷
    steps_per_generation, is the window's loss-mask tokens (all ranks) ÷ processes: DDP's mean over ranks then makes
    every token of the window weigh 1 / window_tokens."""
    return window_tokens * steps_per_generation / micro_batches


def floors_the_count(window_tokens: int, steps_per_generation: int, micro_batches: int) -> bool:
    """Whether TRL's clamp(min=1) of num_items_in_batch bites (a window of fewer loss tokens than micro_batches ÷
    steps_per_generation, none excepted): that window is divided by TRL's floor instead."""
    return 0 < dapo_items(window_tokens, steps_per_generation, micro_batches) < 1


def bonus_shift(micro_tokens: torch.Tensor, micro_batches: int, window_tokens: int, processes: int) -> torch.Tensor:
    """What × coefficient × (this micro-batch's entropy sum over its loss mask) turns TRL's bonus, the micro-batch's
    token mean ÷ micro_batches, into its share of the window's token mean (÷ window tokens of all ranks × processes,
    for DDP's mean): added to the loss, whose bonus TRL subtracted."""
    return 1.0 / (micro_tokens.clamp(min=1) * micro_batches) - processes / max(window_tokens, 1)
