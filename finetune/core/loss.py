"""Summed token-level cross-entropy and the label-token count it is normalized by. Pure functions, no state.

The trainer divides the *sum* over a whole accumulation window (all data-parallel ranks) by the window's label-token
count, so everything here works on one tensor of **targets aligned with the logits**: position t of `targets` is what
the logits at position t predict, -100 where nothing is predicted. How labels become targets depends on the loss kind:

- `CAUSAL_LM`: position t predicts labels[t + 1] (`next_token_targets`), or a collator's own `shift_labels`;
- `TOKEN`: masked LM and token classification, position t predicts labels[t];
- `SEQ2SEQ`: the decoder's logits against the decoder labels, position t predicts labels[t].

Label smoothing is torch's (`F.cross_entropy(label_smoothing=…)`), which per target equals transformers'
`LabelSmoother`: (1 − ε)·NLL + ε·mean over the vocabulary of −log p; summed here, so it stays exact under accumulation.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from finetune.core.labels import IGNORE_INDEX

CAUSAL_LM, TOKEN, SEQ2SEQ, SAMPLE = "causal_lm", "token", "seq2seq", "sample"
LOSS_KINDS = (CAUSAL_LM, TOKEN, SEQ2SEQ, SAMPLE)


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """[..., T] targets of a causal LM: labels shifted left by one, -100 at the last position."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def targets_of(batch, kind: str) -> torch.Tensor:
    """The targets of a collated batch for a loss kind (a causal batch's `shift_labels` win over its `labels`)."""
    if kind == CAUSAL_LM:
        shifted = batch.get("shift_labels") if hasattr(batch, "get") else None
        return shifted if isinstance(shifted, torch.Tensor) else next_token_targets(batch["labels"])
    if kind in (TOKEN, SEQ2SEQ, SAMPLE):
        return batch["labels"]
    raise ValueError(f"unknown loss kind {kind!r}; expected one of {', '.join(LOSS_KINDS)}")


def count_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Targets a causal LM's loss sees: `labels[..., 1:] != -100` (int64 scalar)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def predicting_positions(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions of a causal LM whose next label is a target; the only logits its loss needs."""
    return next_token_targets(labels) != IGNORE_INDEX


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    # Accumulate in float32 (float64 stays float64) whatever the logits' dtype: bf16/fp16 sums drift.
    accumulate = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(accumulate), targets, reduction="sum", label_smoothing=label_smoothing)


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropy over every position with a target, their count) from logits [..., T, V] and aligned
    targets [..., T]. Only the rows of the logits that have a target are upcast."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)} as [..., V]/[...]")
    mask = targets != IGNORE_INDEX
    return _summed_cross_entropy(logits[mask], targets[mask], label_smoothing), mask.sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropy over labelled positions, their count) from a causal LM's [B, T, V] logits."""
    if logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} as [B, T, V]/[B, T]")
    return cross_entropy_sum(logits, next_token_targets(labels))


def row_cross_entropy_sums(
    logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a [B, T] batch: (float64 sum of cross-entropy, int64 target count), both [B]. For evaluation, where
    rows are the unit that ranks gather (and duplicated tail rows of an uneven split are dropped). `logits` are
    [B, T, V], or [N, V] computed only where `targets != -100` (row-major)."""
    mask = targets != IGNORE_INDEX
    kept = logits if logits.dim() == 2 and logits.shape[0] == int(mask.sum()) else logits[mask]
    accumulate = torch.float64 if logits.dtype == torch.float64 else torch.float32
    per_target = F.cross_entropy(
        kept.to(accumulate), targets[mask].to(kept.device), reduction="none", label_smoothing=label_smoothing
    )
    rows = mask.nonzero()[:, 0].to(per_target.device)
    sums = torch.zeros(targets.shape[0], dtype=torch.float64, device=per_target.device)
    return sums.index_add_(0, rows, per_target.double()), mask.sum(-1)


def row_correct_counts(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row of a [B, T] batch: how many targets are the logits' argmax (int64 [B]); logits as row_cross_entropy_sums
    takes them. Token accuracy, for evaluation."""
    mask = targets != IGNORE_INDEX
    kept = logits if logits.dim() == 2 and logits.shape[0] == int(mask.sum()) else logits[mask]
    hits = (kept.argmax(-1) == targets[mask].to(kept.device)).long()
    rows = mask.nonzero()[:, 0].to(hits.device)
    return torch.zeros(targets.shape[0], dtype=torch.int64, device=hits.device).index_add_(0, rows, hits)


def kept_cross_entropy_sum(
    kept_logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sum from logits computed only where `targets != -100` ([N, V], row-major order)."""
    kept, count = _targets_of_kept_rows(kept_logits, targets, "kept logits")
    return _summed_cross_entropy(kept_logits, kept, label_smoothing), torch.tensor(count)


def _targets_of_kept_rows(
    kept_rows: torch.Tensor, targets: torch.Tensor, what: str, kept_index: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """(the targets of kept rows [N, ·] on their device, N): N is the rows' own host count, so no host sync. Checked
    where it costs nothing (a tensor's rank, host targets, the length of a kept index made on the host); on a GPU the
    count is the model's own. `kept_index`: the flat positions of `targets` the rows were taken from."""
    count = kept_rows.shape[0] if kept_rows.dim() == 2 else -1
    if kept_index is not None:
        if count < 0 or kept_index.numel() != count:
            raise ValueError(f"{what} {tuple(kept_rows.shape)} do not match {kept_index.numel()} kept positions")
        return targets.reshape(-1).index_select(0, kept_index).to(kept_rows.device), count
    expected = int((targets != IGNORE_INDEX).sum()) if targets.device.type == "cpu" else count
    if count < 0 or expected != count:
        raise ValueError(f"{what} {tuple(kept_rows.shape)} do not match {expected} targets")
    return kept_targets(targets, count).to(kept_rows.device), count


def sample_loss_sums(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: str, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per item of a batch of sample-level predictions (sequence classification, regression, multiple choice): (its
    loss summed over its values, float64-ready; how many values it has), both [B]. Summed over a window and divided by
    the window's count this is transformers' per-batch mean (`ForSequenceClassificationLoss`) made exact for windows
    of any size: regression and multi-label losses average over every value, single-label ones over items whose label
    is not -100."""
    accumulate = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = labels.shape[0]
    logits = logits.to(accumulate).reshape(rows, -1)
    if problem_type == "single_label_classification":
        labels = labels.reshape(rows).to(logits.device)
        per_item = F.cross_entropy(logits, labels, reduction="none", label_smoothing=label_smoothing)
        return per_item, (labels != IGNORE_INDEX).long()
    values = labels.reshape(rows, -1).to(logits.device, accumulate)
    if problem_type == "regression":
        per_value = (logits - values).pow(2)
    elif problem_type == "multi_label_classification":
        per_value = F.binary_cross_entropy_with_logits(logits, values, reduction="none")
    else:
        raise ValueError(f"unknown problem type {problem_type!r}")
    return per_value.sum(1), torch.full((rows,), per_value.shape[1], dtype=torch.long, device=logits.device)


def kept_positions(targets: torch.Tensor) -> torch.Tensor:
    """The flat positions of `targets` that have a target (int64 [N], row-major): made where the targets are on the
    host, it is the index that takes the kept hidden states without a device-side boolean mask (each of which reads
    its count back to the host, in the forward and again in the backward)."""
    return (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def kept_targets(targets: torch.Tensor, count: int) -> torch.Tensor:
    """`targets[targets != -100]` (row-major) without a host sync: `count` is already known on the host (the rows
    the model kept), so a stable sort puts the kept positions first instead of a data-dependent mask."""
    flat = targets.reshape(-1)
    ignored = (flat == IGNORE_INDEX).to(torch.int32)
    return flat[torch.sort(ignored, stable=True).indices[:count]]


def head_chunk_rows(vocab_size: int, device: torch.device | None = None) -> int:
    """Rows of logits computed at once by the chunked head: about 64 MB of float32 logits per chunk on a CPU, 256 MB
    on a GPU (bigger GEMMs, fewer launches)."""
    budget_elements = 1 << (26 if device is not None and device.type == "cuda" else 24)
    return max(64, budget_elements // max(vocab_size, 1))


@functools.cache
def _mm_takes_out_dtype(device_type: str) -> bool:
    """Whether `torch.mm(..., out_dtype=float32)` runs low-precision GEMMs into float32 outputs here (CUDA)."""
    try:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _matmul(a: torch.Tensor, b: torch.Tensor, accumulate: torch.dtype) -> torch.Tensor:
    """a @ b in a's dtype with its products summed in float32 (what autocast's GEMMs do), returned as `accumulate`:
    straight into float32 where the backend can (no rounding to bf16/fp16 in between)."""
    if a.dtype == accumulate:
        return a @ b
    if a.device.type == "cuda" and _mm_takes_out_dtype("cuda"):
        return torch.mm(a, b, out_dtype=accumulate)
    return (a @ b).to(accumulate)


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T + bias, target_i), never holding more than one chunk of [rows, vocab] logits.

    The gradients are computed chunk by chunk during the forward (softmax − smoothed one-hot is all the backward
    needs), so neither the logits nor their softmax are kept for the backward: memory O(tokens × hidden + vocab ×
    hidden) instead of O(tokens × vocab). The same idea as fused linear-cross-entropy kernels, in plain torch.

    `compute_dtype` (bf16/fp16 under mixed precision) is the GEMMs' input dtype, as autocast would make it for the
    model's own head; logits, the log-sum-exp, the loss and the weight's gradient accumulate in float32 whatever it is.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows: int, label_smoothing: float, compute_dtype):
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # as _summed_cross_entropy
        compute = compute_dtype or weight.dtype
        cast_weight = weight.to(compute)  # once per micro-batch, not per chunk
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=accumulate, device=bias.device)
        loss_sum = torch.zeros((), dtype=accumulate, device=hidden.device)
        hit = 1.0 - label_smoothing
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = hidden[start : start + chunk_rows].to(compute)
            logits = _matmul(rows, cast_weight.t(), accumulate)
            if bias is not None:
                logits += bias.to(accumulate)
            target = targets[start : start + chunk_rows]
            log_norm = torch.logsumexp(logits, dim=-1)
            # per target: logsumexp − (1 − ε)·logit[target] − ε·mean(logits)
            chunk_loss = log_norm - hit * logits.gather(1, target[:, None]).squeeze(1)
            if label_smoothing:
                chunk_loss = chunk_loss - label_smoothing * logits.mean(-1)
            loss_sum += chunk_loss.sum()
            # d/d logits = softmax − (1 − ε)·one_hot − ε/V, computed in place over the chunk's logits
            grad_logits = logits.sub_(log_norm[:, None]).exp_()
            grad_logits[torch.arange(target.shape[0], device=target.device), target] -= hit
            if label_smoothing:
                grad_logits -= label_smoothing / logits.shape[-1]
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(compute)
            grad_hidden[start : start + chunk_rows] = (grad_logits @ cast_weight).to(hidden.dtype)
            if compute == accumulate:  # in place: no second [vocab × hidden] buffer
                grad_weight.addmm_(grad_logits.t(), rows)
            else:
                grad_weight += _matmul(grad_logits.t(), rows, accumulate)
        ctx.save_for_backward(
            grad_hidden, grad_weight.to(weight.dtype), None if grad_bias is None else grad_bias.to(bias.dtype)
        )
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output):
        # Scaled in place: no second [vocab × hidden] buffer while the weight's gradient is accumulated (a second
        # backward through this graph would fail autograd's version check rather than see scaled values).
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        return (
            grad_hidden.mul_(grad_output.to(grad_hidden.dtype)),
            grad_weight.mul_(grad_output.to(grad_weight.dtype)) if ctx.needs_input_grad[1] else None,
            grad_bias.mul_(grad_output.to(grad_bias.dtype))
            if grad_bias is not None and ctx.needs_input_grad[2]
            else None,
            None,
            None,
            None,
            None,
        )


def head_cross_entropy_sum(
    kept_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    compute_dtype: torch.dtype | None = None,
    kept_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss from hidden states where `targets != -100` ([N, H], row-major) and the LM head's weight [V, H]
    (and bias), computed in chunks so that [N, V] logits never exist whole. `compute_dtype`: the GEMMs' dtype under
    mixed precision (None: the ambient autocast's, else the weight's). `kept_index`: the flat positions of `targets`
    the rows are (int64 [N], made on the host from the labels: `kept_positions`). The count is the host's (N): no host
    sync."""
    kept, count = _targets_of_kept_rows(kept_hidden, targets, "kept hidden states", kept_index)
    if count == 0:  # keeps the graph (zero gradients) without an empty matmul
        return kept_hidden.sum() * 0.0, torch.tensor(0)
    device = kept_hidden.device
    chunk_rows = head_chunk_rows(weight.shape[0], device)
    # Called inside autocast (the planner's trials, a user's loop), its dtype is the GEMMs'; the float32 parts must
    # not be autocast back down, so autocast is off inside and the dtype is passed on explicitly.
    if compute_dtype is None and torch.is_autocast_enabled(device.type):
        compute_dtype = torch.get_autocast_dtype(device.type)
    with torch.autocast(device.type, enabled=False):
        total = _ChunkedHeadCrossEntropy.apply(
            kept_hidden, weight, bias, kept, chunk_rows, label_smoothing, compute_dtype
        )
    return total, torch.tensor(count)


def scalar_loss_of_func(loss) -> torch.Tensor:
    """A `compute_loss_func`'s return as a 0-d tensor: it must be one scalar (its sum over labelled positions ÷ the
    num_items_in_batch it was given)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"compute_loss_func must return a scalar loss tensor (the sum over labelled positions "
            f"÷ num_items_in_batch); it returned {shape}"
        )
    return loss.reshape(())
