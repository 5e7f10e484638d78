"""The reference side of `finetune.verify`: what a training window held and applied, and that gradient recomputed.

- `recording_trainer`: the recipe's trainer class recording into a `WindowRecorder` (a subclass built with, not a
  trainer patched afterwards): the rows of every micro-batch as the collator got them, grouped per fetched window,
  the norm the trainer clipped with, and (`GradientCapture`, a callback) before each optimizer step the applied
  gradient, the parameters and the rows of all ranks (gathered to rank 0).
- `reference_placement`, `reference_gradient`: the token-mean next-token cross-entropy over those rows, each sequence
  alone and unpadded, in float64 where it fits (else float32), with the loss written out here (not `finetune.loss`).
- `compare`, `micro_batch_weights`: the relative error overall and per parameter group, and the least-squares weight
  of each micro-batch in the applied gradient.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

from finetune.env import is_main_process
from finetune.labels import IGNORE_INDEX
from finetune.recipe import RecipeError


def group_of(name: str) -> str:
    """Parameter group for the report: up to the layer index (`model.layers.3`), else the owning module."""
    name = name.removeprefix("base_model.model.")  # PEFT's wrapper prefix
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def silence_dropout(model) -> None:
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class WindowRecorder:
    """What verify keeps of a training run: the rows of every micro-batch as the collator got them (before padding or
    packing), grouped per fetched window; the gradient norm each optimizer step clipped with; and, per step, the
    capture `GradientCapture` takes before the update.

    The collator runs one micro-batch ahead of the loop (accelerate's look-ahead), so rows wait in a queue until
    `get_batch_samples` says how many micro-batches the window took.
    """

    def __init__(self):
        self.pending: deque = deque()
        self.windows: list[list[list[dict]]] = []  # per window: its micro-batches' rows
        self.norms: list[float] = []  # per optimizer step: the norm the trainer clipped with
        self.captures: list[dict] = []  # per optimizer step (empty dicts on ranks other than 0)
        self.collate = None  # the recipe's own collator

    def recording(self, collate):
        """`collate` that also keeps each micro-batch's rows."""
        self.collate = collate

        def recording_collator(features):
            rows = [row for item in features for row in (item if isinstance(item, list) else [item])]
            self.pending.append([dict(row) for row in rows])
            return collate(features)

        return recording_collator

    def window_fetched(self, micro_batches: int) -> None:
        self.windows.append([self.pending.popleft() for _ in range(micro_batches)])


def recording_trainer(base: type, recorder: WindowRecorder, steps: int) -> type:
    """`base` (the recipe's trainer class) recording into `recorder` for `steps` optimizer steps, then stopping: the
    trainer class verify builds with. The Trainer's own progress bar and step lines are left out."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ProgressCallback

    class GradientCapture(TrainerCallback):
        """Before each optimizer step: the applied gradient, the parameters and all ranks' rows (gathered to rank 0)."""

        def __init__(self, trainer):
            self.trainer = trainer

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            import torch
            import torch.distributed as dist

            trainer = self.trainer
            trainable = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
            if any(hasattr(p, "full_tensor") for _, p in trainable):
                raise RecipeError(
                    "finetune.verify needs whole parameters on rank 0; run it with DDP or one process, "
                    "not FSDP (the gradient math is the same)"
                )
            if all(p.grad is None for _, p in trainable):
                raise RecipeError(
                    "no gradient on the parameters before the optimizer step (DeepSpeed keeps them in "
                    "its engine); run finetune.verify with DDP or one process"
                )
            # Under fp16 the gradients are unscaled already: the Trainer's _get_grad_norm runs before this hook and
            # unscales through accelerate's clip_grad_norm_ even without clipping (max_grad_norm=0 clips at inf).
            keep = lambda t: t.detach().to("cpu", torch.float64 if t.dtype == torch.float64 else torch.float32)  # noqa
            grads = {n: keep(_full(p.grad)) if p.grad is not None else None for n, p in trainable}
            rows = recorder.windows[len(recorder.captures)]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, rows)
                rows = [micro_batch for rank_rows in gathered for micro_batch in rank_rows]
            if is_main_process():
                params = {n: p.detach().to("cpu", copy=True) for n, p in trainable}
                norm = recorder.norms[-1] if args.max_grad_norm > 0 else None
                recorder.captures.append(
                    {"grads": grads, "params": params, "rows": rows, "step": state.global_step + 1, "norm": norm}
                )
            else:
                recorder.captures.append({})

        def on_step_end(self, args, state, control, **kwargs):
            if len(recorder.captures) >= steps:
                control.should_training_stop = True

    class RecordingTrainer(base):
        def __init__(self, *args, data_collator=None, callbacks=None, **kwargs):
            kept = [c for c in callbacks or [] if not isinstance(c, ProgressCallback)]
            super().__init__(
                *args,
                data_collator=recorder.recording(data_collator),
                callbacks=[*kept, GradientCapture(self)],
                **kwargs,
            )

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            samples, count = super().get_batch_samples(epoch_iterator, num_batches, device)
            recorder.window_fetched(len(samples))
            return samples, count

        def _clip_grad_norm(self, model):
            # The reference is clipped by the factor the trainer clipped with, so the check is of the gradient, not of
            # the rounding of torch's float32 norm over millions of elements (both norms are reported).
            norm = super()._clip_grad_norm(model)
            recorder.norms.append(float(norm))
            return norm

    return RecordingTrainer


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor shard → the whole tensor


def reference_model(accelerator, model):
    """The trained model without accelerate's mixed-precision forward: that wrapper autocasts, so a float32 reference
    would silently run in bf16/fp16 (float64 is never autocast, float32 is)."""
    return accelerator.unwrap_model(model, keep_fp32_wrapper=False)


def reference_placement(model, trainable: int):
    """(dtype, device) for the reference: float64 where it fits, else float32; the training device before the CPU."""
    import psutil
    import torch

    total = sum(p.numel() for p in model.parameters())
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    device = next(model.parameters()).device
    room = {torch.device("cpu"): psutil.virtual_memory().available + (held if device.type == "cpu" else 0)}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trainer's freed optimizer state and activations still sit in torch's cache
        room = {device: torch.cuda.mem_get_info(device)[0] + held, **room}
    for where, free in room.items():
        for dtype in (torch.float64, torch.float32):
            # weights + gradients, and a quarter again for one sequence's activations
            if (total + trainable) * (8 if dtype == torch.float64 else 4) * 1.25 <= free:
                return dtype, where
    raise RecipeError(
        f"the float32 reference model ({(total + trainable) * 4 / 2**30:.1f} GiB with gradients) fits "
        "neither the accelerator nor the free RAM; verify a smaller model or free memory"
    )


def reference_gradient(model, micro_batches: list[list[dict]], inputs_of, dtype, device, keep_parts: bool):
    """Token-mean next-token cross-entropy over all rows, each sequence alone (`inputs_of(row)`: its model inputs).

    Returns ({name: grad}, mean loss, targets, per-micro-batch gradients (float32, CPU) or None).
    """
    import torch

    rows = [row for micro_batch in micro_batches for row in micro_batch]
    targets_total = sum(sum(1 for t in r["labels"][1:] if t != IGNORE_INDEX) for r in rows)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    loss_sum, parts, previous = 0.0, [], {}
    for micro_batch in micro_batches:
        for row in micro_batch:
            targets = torch.tensor(row["labels"][1:], device=device)  # position t predicts token t + 1
            picked = targets != IGNORE_INDEX
            if not picked.any():
                continue
            out = model(**inputs_of(row))
            logits = (out.logits if hasattr(out, "logits") else out["logits"])[0, :-1]
            log_probs = torch.log_softmax(logits[picked].to(dtype), dim=-1)
            sequence_loss = -log_probs.gather(1, targets[picked].unsqueeze(1)).sum()
            (sequence_loss / targets_total).backward()  # one sequence at a time: the gradients add up
            loss_sum += float(sequence_loss.detach())
        if keep_parts:  # this micro-batch's share: the running sum now minus before
            now = {
                n: p.grad.float().cpu() if p.grad is not None else torch.zeros(p.shape) for n, p in trainable.items()
            }
            parts.append({n: g - previous[n] if previous else g for n, g in now.items()})
            previous = now
    grads = {n: p.grad.detach() if p.grad is not None else torch.zeros_like(p) for n, p in trainable.items()}
    return grads, loss_sum / max(targets_total, 1), targets_total, parts if keep_parts else None


def micro_batch_weights(applied: dict, parts: list[dict], scale: float) -> list[float]:
    """Least-squares w with applied ≈ Σ_k w_k × scale × part_k (1 everywhere when every token counts once)."""
    import torch

    used = [k for k, part in enumerate(parts) if any(bool(g.any()) for g in part.values())]
    gram = torch.zeros(len(used), len(used), dtype=torch.float64)
    dots = torch.zeros(len(used), dtype=torch.float64)
    for name in parts[0]:
        target = applied[name].flatten() if applied.get(name) is not None else torch.zeros(parts[0][name].numel())
        for start in range(0, target.numel(), 1 << 22):  # chunks: K × 4M floats at a time
            block = torch.stack([parts[k][name].flatten()[start : start + (1 << 22)] for k in used]).double()
            gram += block @ block.T
            dots += block @ target[start : start + (1 << 22)].double()
    solution = torch.linalg.lstsq(gram, dots.unsqueeze(1)).solution.squeeze(1) / scale
    weights = [math.nan] * len(parts)  # a micro-batch without targets has no weight
    for k, w in zip(used, solution.tolist()):
        weights[k] = w
    return weights


def compare(applied: dict, reference: dict) -> tuple[float, dict[str, tuple[float, float]]]:
    """Relative error over everything and per parameter group (0 where both are zero)."""
    diff, norm = defaultdict(float), defaultdict(float)
    for name, ref in reference.items():
        ref = ref.double().cpu()
        got = applied[name].double() if applied.get(name) is not None else ref.new_zeros(ref.shape)
        diff[group_of(name)] += float(((got - ref) ** 2).sum())
        norm[group_of(name)] += float((ref**2).sum())
    ratio = lambda d, n: math.sqrt(d / n) if n > 0 else (0.0 if d == 0 else math.inf)  # noqa: E731
    groups = {g: (ratio(diff[g], norm[g]), math.sqrt(norm[g])) for g in diff}
    return ratio(sum(diff.values()), sum(norm.values())), groups
