"""The reference side of `finetune.verify`: what a training window held and applied, and that gradient recomputed.

- `recording_trainer`: the recipe's trainer class recording into a `WindowRecorder` (a subclass built with, not a
  trainer patched afterwards): the rows of every micro-batch as the collator got them, grouped per fetched window,
  the norm the trainer clipped with, and (`gradient_capture`, a callback) before each optimizer step the applied
  gradient, the parameters and the rows of all ranks (gathered to rank 0); before the first forward (`probed`) its
  first micro-batch runs twice through the model, and what draws at random runs in evaluation mode from then on.
- `reference_placement`, `reference_model`: where the reference runs: float64 where it fits (else float32), without
  accelerate's autocast. The gradient itself is `finetune.testing.reference.window_gradient`, the brute force the
  tests use too: each sequence alone and unpadded, the loss written out there (not `finetune.core.loss`).
- `compare`, `micro_batch_weights`: the relative error overall and per parameter group, and the least-squares weight
  of each micro-batch in the applied gradient.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

from finetune.env import is_main_process
from finetune.recipe import RecipeError


def group_of(name: str) -> str:
    """Parameter group for the report: up to the layer index (`model.layers.3`), else the owning module."""
    name = name.removeprefix("base_model.model.")  # PEFT's wrapper prefix
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


class WindowRecorder:
    """What verify keeps of a training run: the rows of every micro-batch as the collator got them (before padding or
    packing), grouped per fetched window; the gradient norm each optimizer step clipped with; and, per step, the
    capture `GradientCapture` takes before the update.

    The collator runs one micro-batch ahead of the loop (accelerate's look-ahead), so rows wait in a queue until
    `get_batch_samples` says how many micro-batches the window took.
    """

    def __init__(self, threshold: float = 1e-6):
        self.threshold = threshold  # relative change between two identical forwards above which one is random
        self.evaluated: list[str] | None = None  # modules that draw at random, run in evaluation mode; None: unprobed
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


def host_copy(tensor):
    """A CPU copy in float64 if it is float64, else float32 (bf16/fp16 gradients are compared in float32)."""
    import torch

    return tensor.detach().to("cpu", torch.float64 if tensor.dtype == torch.float64 else torch.float32)


def check_capturable(trainable: list) -> None:
    """verify needs whole gradients on rank 0 before the optimizer step: not FSDP shards, not DeepSpeed's engine."""
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


def all_ranks_rows(rows: list[list[dict]]) -> list[list[dict]]:
    """This window's micro-batches of every rank, rank by rank (this rank's alone outside a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return rows
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return [micro_batch for rank_rows in gathered for micro_batch in rank_rows]


def gradient_capture(trainer, recorder: WindowRecorder, steps: int):
    """The callback that, before each optimizer step, captures the applied gradient, the parameters and all ranks'
    rows (gathered to rank 0) into `recorder`, and stops training after `steps` steps."""
    from transformers import TrainerCallback

    class GradientCapture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            trainable = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
            check_capturable(trainable)
            # Under fp16 the gradients are unscaled already: the Trainer's _get_grad_norm runs before this hook and
            # unscales through accelerate's clip_grad_norm_ even without clipping (max_grad_norm=0 clips at inf).
            grads = {n: host_copy(_full(p.grad)) if p.grad is not None else None for n, p in trainable}
            rows = all_ranks_rows(recorder.windows[len(recorder.captures)])
            if not is_main_process():
                recorder.captures.append({})
                return
            params = {n: p.detach().to("cpu", copy=True) for n, p in trainable}
            norm = recorder.norms[-1] if args.max_grad_norm > 0 else None
            step = state.global_step + 1
            recorder.captures.append({"grads": grads, "params": params, "rows": rows, "step": step, "norm": norm})

        def on_step_end(self, args, state, control, **kwargs):
            if len(recorder.captures) >= steps:
                control.should_training_stop = True

    return GradientCapture()


def recording_trainer(base: type, recorder: WindowRecorder, steps: int) -> type:
    """`base` (the recipe's trainer class) recording into `recorder` for `steps` optimizer steps, then stopping: the
    trainer class verify builds with. The Trainer's own progress bar and step lines are left out."""
    from transformers.trainer_callback import ProgressCallback

    class RecordingTrainer(base):
        def __init__(self, *args, data_collator=None, callbacks=None, **kwargs):
            kept = [c for c in callbacks or [] if not isinstance(c, ProgressCallback)]
            super().__init__(
                *args,
                data_collator=recorder.recording(data_collator),
                callbacks=[*kept, gradient_capture(self, recorder, steps)],
                **kwargs,
            )

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            if recorder.evaluated is None:  # before the first forward, a routing pass of moe_balance=window included
                epoch_iterator = probed(self, epoch_iterator, recorder)
            samples, count = super().get_batch_samples(epoch_iterator, num_batches, device)
            recorder.window_fetched(len(samples))
            return samples, count

        def release_training_state(self) -> None:
            """Once trained: the optimizer, the schedule and the wrapped model let go of, so the reference has room."""
            self.optimizer = self.lr_scheduler = self.model_wrapped = None
            self.accelerator.free_memory()

        def _clip_grad_norm(self, model):
            # The reference is clipped by the factor the trainer clipped with, so the check is of the gradient, not of
            # the rounding of torch's float32 norm over millions of elements (both norms are reported).
            norm = super()._clip_grad_norm(model)
            recorder.norms.append(float(norm))
            return norm

    return RecordingTrainer


def probed(trainer, epoch_iterator, recorder: WindowRecorder):
    """`epoch_iterator` as it was, its first micro-batch having run twice through the model to find what draws at
    random (finetune/testing/determinism.py): such modules run in evaluation mode from now on, said in one line, or
    the run is refused in one line where that does not make the forward deterministic."""
    import itertools

    from finetune.testing.determinism import NotDeterministic, describe, make_deterministic

    first = next(epoch_iterator, None)
    if first is None:
        return epoch_iterator
    model = trainer.accelerator.unwrap_model(trainer.model)
    try:
        recorder.evaluated = make_deterministic(model, trainer._prepare_inputs(first), recorder.threshold)
    except NotDeterministic as random:
        raise RecipeError(
            f"finetune.verify: the training forward is random: {describe(model, random.args[0])} gives a different "
            "output for the same input on each call, in evaluation mode too (dropout is off already); the trainer "
            "and the brute force would see different draws, so no step can be checked: remove that draw from the "
            "forward to verify this model"
        ) from None
    if recorder.evaluated and is_main_process():
        print(
            f"verify: {describe(model, recorder.evaluated)} gives a different output for the same input in training "
            "mode (a random draw in its forward); the check runs it in evaluation mode (no draw), in the trained "
            "model and the reference alike",
            flush=True,
        )
    return itertools.chain([first], epoch_iterator)


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


def ratio(diff: float, norm: float) -> float:
    """sqrt(diff / norm): the relative error, 0 where both are zero."""
    return math.sqrt(diff / norm) if norm > 0 else (0.0 if diff == 0 else math.inf)


def compare(applied: dict, reference: dict) -> tuple[float, dict[str, tuple[float, float]]]:
    """Relative error over everything and per parameter group (0 where both are zero)."""
    diff, norm = defaultdict(float), defaultdict(float)
    for name, ref in reference.items():
        ref = ref.double().cpu()
        got = applied[name].double() if applied.get(name) is not None else ref.new_zeros(ref.shape)
        diff[group_of(name)] += float(((got - ref) ** 2).sum())
        norm[group_of(name)] += float((ref**2).sum())
    groups = {g: (ratio(diff[g], norm[g]), math.sqrt(norm[g])) for g in diff}
    return ratio(sum(diff.values()), sum(norm.values())), groups
