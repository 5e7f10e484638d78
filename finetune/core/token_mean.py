"""The exactness rule on one screen: what makes a step's gradient, and an evaluation's loss, the exact mean over
label tokens. `TokenNormTrainer`'s hooks only call these functions; pure (torch only).

Training, per optimizer step (K micro-batches per rank, R data-parallel ranks):

1. `window_label_tokens`: the label tokens of the whole window, counted before its first forward (the window is
   prefetched) and summed over the R ranks — every micro-batch then divides by the same N.
2. Each micro-batch's loss is the **sum** of its per-token losses, never the model's own mean (a mean of means
   weighs a token of a short micro-batch more than one of a long one).
3. `window_loss` divides that sum by N, so every token of the window weighs 1/N, whatever micro-batch or rank it is
   in, and multiplies by R, because DDP, FSDP and ZeRO average gradients over ranks: the average of R sums ÷ N,
   times R, is the sum over all ranks ÷ N.
4. Nothing divides again: `Trainer.loss_is_scaled_for_ga` is True (no ÷ K), and the gradient is clipped once, on
   the whole window's gradient, then the optimizer steps.
5. An empty window (N = 0 on every rank) divides by 1 (its sum is 0: zero gradients, never 0/0), and
   `updates_weights` vetoes the step: a zero gradient would still move AdamW's moments and decay the weights.

Evaluation: every row's loss sum and label tokens are gathered over ranks (rows repeated to even out the last batches
dropped) and summed over the whole set in float64; `eval_metrics` divides once, at the end, so the eval loss does not
move with the eval batch size, the last short batch or the number of ranks.
"""

from __future__ import annotations

import torch

# One row per evaluated row (or batch) of the columns an evaluation sums, in float64.
EVAL_COLUMNS = ("loss_sum", "label_tokens", "rows", "correct", "accuracy_tokens")


def window_loss(loss_sum: torch.Tensor, window_label_tokens: int | torch.Tensor, data_parallel_size: int):
    """The loss one micro-batch backpropagates: its summed loss ÷ the window's label tokens (all ranks) × the
    data-parallel size (rules 3 and 5 above). A host number divides without a copy to the device."""
    if isinstance(window_label_tokens, torch.Tensor):
        divisor = window_label_tokens.clamp(min=1).to(loss_sum.device)
    else:
        divisor = max(int(window_label_tokens), 1)
    return loss_sum / divisor * data_parallel_size


def balance_share(aux_loss: torch.Tensor, coefficient: float, window_micro_batches: int) -> torch.Tensor:
    """One micro-batch's share of a mixture of experts' router balancing loss (the model's `aux_loss`, defined over
    that micro-batch's tokens, weighted by its `router_aux_loss_coef`): ÷ the window's micro-batches on this rank, not
    × the data-parallel size, so that with DDP's average over ranks the step's gradient is the coefficient × the mean
    of the balancing loss over the window's micro-batches and ranks, the weight the user set. (`Trainer` adds the term
    once per micro-batch: K× that weight, and R× more where it averages tokens across devices.)"""
    return aux_loss * (coefficient / max(window_micro_batches, 1))


def batch_mean(loss_sum: torch.Tensor, label_tokens: torch.Tensor) -> torch.Tensor:
    """One batch's own token mean: what an evaluation step reports, or a direct call without a window."""
    return loss_sum / label_tokens.clamp(min=1)


def updates_weights(window_label_tokens: int | None) -> bool:
    """Rule 5: a window without any label token on any rank makes no update (None: not counted, as Trainer)."""
    return window_label_tokens != 0


def eval_rows(
    loss_sums: torch.Tensor,
    label_tokens: torch.Tensor,
    correct: torch.Tensor | None = None,
) -> torch.Tensor:
    """[rows, EVAL_COLUMNS] float64 figures of evaluated rows (or one batch); `correct`: argmax hits per row, None
    where no logits were seen (the accuracy is then not reported)."""
    loss_sums, label_tokens = loss_sums.reshape(-1).double(), label_tokens.reshape(-1).double()
    hits = correct.reshape(-1).double() if correct is not None else torch.zeros_like(loss_sums)
    counted = label_tokens if correct is not None else torch.zeros_like(loss_sums)
    return torch.stack([loss_sums, label_tokens, torch.ones_like(loss_sums), hits, counted], dim=1)


def eval_metrics(totals: list[float], prefix: str) -> dict[str, float]:
    """The exact figures of a whole eval set from its summed columns: `{prefix}_loss` (token mean),
    `{prefix}_label_tokens` and, where every label token's prediction was seen, `{prefix}_token_accuracy`."""
    sums = dict(zip(EVAL_COLUMNS, totals))
    if sums["label_tokens"] <= 0:
        return {}
    metrics = {f"{prefix}_loss": sums["loss_sum"] / sums["label_tokens"]}
    metrics[f"{prefix}_label_tokens"] = int(sums["label_tokens"])
    if sums["accuracy_tokens"] == sums["label_tokens"]:
        metrics[f"{prefix}_token_accuracy"] = sums["correct"] / sums["label_tokens"]
    return metrics


def combined_metrics(metrics: dict[str, float], names: list[str], prefix: str) -> dict[str, float]:
    """The figures over several eval sets' tokens from each set's (`{prefix}_{name}_loss`, `_label_tokens`,
    `_token_accuracy`): a mean × its count gives back each set's float64 sum, so the whole is the token mean of all of
    them, not a mean of the sets' means."""
    tokens = [metrics.get(f"{prefix}_{n}_label_tokens", 0) for n in names]
    if sum(tokens) <= 0:
        return {}
    loss = sum(metrics[f"{prefix}_{n}_loss"] * t for n, t in zip(names, tokens) if t) / sum(tokens)
    combined = {f"{prefix}_loss": loss, f"{prefix}_label_tokens": int(sum(tokens))}
    accuracies = [metrics.get(f"{prefix}_{n}_token_accuracy") for n, t in zip(names, tokens) if t]
    if all(a is not None for a in accuracies):
        hits = sum(a * t for a, t in zip(accuracies, (t for t in tokens if t)))
        combined[f"{prefix}_token_accuracy"] = hits / sum(tokens)
    return combined
