"""`TokenNormTrainer`: a drop-in `transformers.Trainer` whose gradient is the exact token mean of the whole window.

Per optimizer step the Trainer already prefetches the accumulation window (`get_batch_samples`), clips once after it
and steps once. This class changes only what is normalized by what, at the Trainer's documented hooks:

- `get_batch_samples`: counts the window's targets after the causal shift and sums them over data-parallel ranks
  (`window_label_tokens`); that count is what `training_step` then passes to `compute_loss`;
- `compute_loss`: sums next-token cross-entropy from the model's logits (its own loss is never used) and divides by
  `window_label_tokens`, times the data-parallel size to cancel DDP/FSDP/ZeRO gradient averaging. The loss is then
  already scaled for accumulation (`loss_is_scaled_for_ga = True`), so the Trainer does not divide again, and
  DeepSpeed's GAS scaling is off (the Trainer passes `scale_wrt_gas=False`);
- `create_optimizer`: a window with no target makes no update;
- `log`: adds `window_label_tokens` to each logged step.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import logging

from finetune.checkpoints import AtomicCheckpoints, epoch_seeded
from finetune.config import RecipeError
from finetune.loss import head_token_loss_sum, kept_token_loss_sum, predicting_positions, token_loss_sum
from finetune.meter import WindowMeter, flops_per_token, matmul_parameters, peak_flops, window_counts

logger = logging.get_logger(__name__)


def logits_of(outputs: Any) -> torch.Tensor | None:
    """The [B, T, V] logits in whatever a model returned: a tensor, a ModelOutput/dict, or a tuple."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits
    if isinstance(outputs, (tuple, list)):
        return next((o for o in outputs if isinstance(o, torch.Tensor) and o.dim() == 3), None)
    return None


def plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head if the chunked loss can use its weight directly: a plain nn.Linear whose parameters are
    ordinary tensors (not FSDP2 DTensors or ZeRO-3 partitions, which exist whole only inside the module's forward)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not torch.nn.Linear:
        return None
    params = [p for p in (head.weight, head.bias) if p is not None]
    if any(type(p.data) is not torch.Tensor or hasattr(p, "ds_id") for p in params):
        return None
    return head


@contextlib.contextmanager
def head_passes_hidden_states(head: torch.nn.Module | None):
    """While active, the LM head returns its input: the model returns hidden states where it would return logits."""
    if head is None:
        yield
        return
    head.forward = lambda hidden_states: hidden_states  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del head.forward


class TokenNormTrainer(Trainer):
    """`transformers.Trainer` with exact token-mean gradients under accumulation and data parallelism."""

    # compute_loss divides by the whole window's label tokens: the Trainer must not divide by accumulation again.
    loss_is_scaled_for_ga = True
    _skip_update = False  # set by a subclass to make the next optimizer step no update

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.get_cp_size() > 1 or self.get_sp_size() > 1:
            raise NotImplementedError(
                "TokenNormTrainer computes the loss from full-sequence logits; context/sequence parallelism shards "
                "the sequence. Use data parallelism (DDP, FSDP, ZeRO) or tensor parallelism."
            )
        forward = inspect.signature(self.accelerator.unwrap_model(self.model).forward).parameters
        labels_param = forward.get("labels")
        # A model whose forward requires labels gets them; all others are spared computing a loss we never use.
        self._forward_needs_labels = labels_param is not None and labels_param.default is inspect.Parameter.empty
        # Training never reads a KV cache, and with one transformers does not derive the block-diagonal mask of
        # packed rows from their position_ids (attention would cross sequences).
        self._no_cache = {"use_cache": False} if "use_cache" in forward else {}
        # Logits only where a target is: prompt and padding positions never reach the LM head (most of the FLOPs and
        # memory of a small model with a large vocabulary). transformers takes a [B, T] bool mask here.
        self._keeps_logits = "logits_to_keep" in forward
        # With kept positions, the LM head and cross-entropy run chunk by chunk on hidden states ([N, vocab] logits
        # never exist whole) once a first forward has shown that the model returns the head's output unchanged
        # (no soft-capping or scaling after it). None: not probed yet; False: use the model's logits.
        self._chunked_head: torch.nn.Linear | None | bool = None if self._keeps_logits else False
        self._falls_back = False  # the model returned no [B, T, V] logits: behave exactly as Trainer
        self._trainer_num_items = None  # Trainer's own count, used only when falling back
        self._window_label_tokens: int | None = None
        self._meter = WindowMeter()
        # MFU is logged where the device's peak is known (a table of GPUs); set trainer.peak_flops to override.
        self.peak_flops = peak_flops("bf16" if self.args.bf16 or self.args.fp16 else "fp32")
        self._matmul_params: int | None = None

    # ---- window: count targets over all data-parallel ranks ----

    def _data_parallel_size(self) -> int:
        # Tensor-parallel ranks hold replicas of one batch; only data-parallel ranks see different data.
        return self.accelerator.num_processes // self.get_tp_size()

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        # A prefetched window holds K micro-batches: keep them on the host (pinned on a GPU machine) until their turn;
        # training_step moves each one to the device as it runs.
        if getattr(dataloader, "device", None) is not None:
            dataloader.device = None
        return dataloader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, self._trainer_num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._falls_back or not batch_samples or "labels" not in batch_samples[0]:
            self._window_label_tokens = None
            return batch_samples, self._trainer_num_items
        # One all-reduce per window for every count (label tokens first); tensor-parallel ranks hold replicas.
        counts = torch.tensor(window_counts(batch_samples), dtype=torch.int64, device=device)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum") // self.get_tp_size()
        self._meter.add(counts.tolist())
        window_label_tokens = counts[0]
        self._window_label_tokens = int(window_label_tokens)
        if self._window_label_tokens == 0:
            logger.warning(
                f"optimizer step {self.state.global_step + 1}: the accumulation window has no labelled token on any "
                "rank; the weights are not updated for this step"
            )
        return batch_samples, window_label_tokens

    # ---- loss: sum from the logits, divided by the window's count ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._falls_back or "labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        forward_inputs = inputs if self._forward_needs_labels else {k: v for k, v in inputs.items() if k != "labels"}
        keep = {"logits_to_keep": predicting_positions(labels)} if self._keeps_logits else {}
        chunked = bool(keep) and torch.is_grad_enabled() and not return_outputs
        outputs, hidden = self._forward(model, {**forward_inputs, **self._no_cache, **keep}, chunked)
        logits = logits_of(outputs)
        if hidden is not None:
            head = self._chunked_head
            loss_sum, label_tokens = head_token_loss_sum(hidden, head.weight, head.bias, labels)
        elif keep and logits is not None and logits.dim() == 2:
            loss_sum, label_tokens = kept_token_loss_sum(logits, labels)
        elif logits is not None and logits.dim() == 3 and logits.shape[:2] == labels.shape:
            loss_sum, label_tokens = token_loss_sum(logits, labels)
        else:
            return self._fall_back(model, inputs, return_outputs, logits)
        if num_items_in_batch is None:  # outside the training loop (evaluation): this batch's own token mean
            loss = loss_sum / label_tokens.clamp(min=1)
        else:
            # clamp: an empty window has loss_sum 0 and makes zero gradients, never 0/0.
            window_label_tokens = torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
            loss = loss_sum / window_label_tokens * self._data_parallel_size()
        return (loss, outputs) if return_outputs else loss

    def _forward(self, model, inputs: dict, chunked: bool):
        """(model outputs, the kept positions' hidden states where the chunked head computes the loss, else None)."""
        if chunked and self._chunked_head is None:
            self._chunked_head = self._probe_head(model, inputs) or False
        if not chunked or not self._chunked_head:
            return model(**inputs), None
        with head_passes_hidden_states(self._chunked_head):
            outputs = model(**inputs)
        return outputs, logits_of(outputs)

    def _probe_head(self, model, inputs: dict) -> torch.nn.Linear | None:
        """The LM head if the model returns its output unchanged (no soft-capping or scaling after it), else None.

        Once per run: a forward without gradients on the unwrapped model whose head is fed one row, so no
        [tokens × vocab] logits are made; random state untouched, so a resumed run's steps equal the uninterrupted run's.
        """
        unwrapped = self.accelerator.unwrap_model(model)
        head = plain_head(unwrapped)
        if head is None:
            return None
        seen = []
        one_row = head.register_forward_pre_hook(lambda module, args: (args[0].narrow(-2, 0, 1), *args[1:]))
        record = head.register_forward_hook(lambda module, args, output: seen.append(output))
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                outputs = unwrapped(**inputs)
        finally:
            one_row.remove()
            record.remove()
        return head if len(seen) == 1 and logits_of(outputs) is seen[0] else None

    def _fall_back(self, model, inputs, return_outputs, logits):
        shape = "nothing" if logits is None else f"a tensor of shape {tuple(logits.shape)}"
        logger.warning(
            f"TokenNormTrainer: the model returned {shape} where [batch, tokens, vocab] logits matching the labels "
            "were expected; falling back to transformers.Trainer's loss (exact only if the model sums its loss over "
            "num_items_in_batch)."
        )
        self._falls_back = True
        self.loss_is_scaled_for_ga = None  # let Trainer decide as it would for this model
        return super().compute_loss(model, inputs, return_outputs, self._trainer_num_items)

    # ---- an empty window makes no update ----

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if not getattr(optimizer, "_skips_empty_windows", False):
            step = optimizer.step

            def step_unless_window_empty(*args, **kwargs):
                # Gradients of an empty window are zeros, but AdamW/momentum would still move the weights.
                # _skip_update: a subclass's veto for this step (RecipeTrainer: non-finite loss or gradients).
                if self._window_label_tokens == 0 or self._skip_update:
                    return None
                return step(*args, **kwargs)

            optimizer.step = step_unless_window_empty
            optimizer._skips_empty_windows = True
        return optimizer

    # ---- logging ----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and "grad_norm" in logs:  # an optimizer-step line, not the end-of-training summary
            logs.update(self._meter.drain())
            if self.peak_flops and logs.get("real_tokens_per_s"):
                # model FLOPs of the real tokens only: padding and skipped prompt logits count as waste
                model = self.accelerator.unwrap_model(self.model)
                if self._matmul_params is None:
                    self._matmul_params = matmul_parameters(model)
                per_token = flops_per_token(model, logs["mean_sequence_tokens"], self._matmul_params)
                job_peak = self.peak_flops * self.accelerator.num_processes  # the token rate is the whole job's
                logs["mfu"] = logs["real_tokens_per_s"] * per_token / job_peak
            if self.args.max_grad_norm > 0 and logs["grad_norm"] is not None:
                logs["clip_factor"] = min(1.0, self.args.max_grad_norm / (logs["grad_norm"] + 1e-6))
        super().log(logs, start_time)


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


class RecipeTrainer(AtomicCheckpoints, TokenNormTrainer):
    """What `finetune/train.py` runs: TokenNormTrainer with the recipe's optimizer and schedule.

    Both are built at the Trainer's own hooks, so the optimizer sees the model as FSDP2/ZeRO wrap it, and the schedule
    gets the Trainer's count of optimizer steps (never micro-batches) and is stepped by the Trainer once per step.
    Checkpoints are complete or absent (AtomicCheckpoints, finetune/checkpoints.py). Once per optimizer step, before
    the update, all ranks agree on whether the loss or gradients were non-finite (train.on_nonfinite: skip the update,
    counted as `nonfinite_skipped`, or stop) and whether a stop was requested (SIGTERM/SIGINT: save, then stop).
    """

    def __init__(self, *args, optim_config, schedule_config, peak_lr: float, on_nonfinite: str = "skip",
                 stop_request=None, **kwargs):
        self.optim_config, self.schedule_config, self.peak_lr = optim_config, schedule_config, peak_lr
        self.on_nonfinite, self.stop_request = on_nonfinite, stop_request
        self.nonfinite_skipped = 0  # optimizer steps without an update: non-finite values, or fp16 GradScaler overflow
        self._window_finite: bool | torch.Tensor = True
        super().__init__(*args, **kwargs)

    def _get_train_sampler(self, train_dataset=None):
        return epoch_seeded(super()._get_train_sampler(train_dataset), self.args.seed)

    def checkpoint_state(self) -> dict:
        return {"nonfinite_skipped": self.nonfinite_skipped, "data_position": self._data_position()}

    def restore_checkpoint_state(self, state: dict) -> None:
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
        # The Trainer skips global_step × accumulation micro-batches into the epoch: the same position only if these
        # agree (another data.limit, seed or number of ranks resumes somewhere else, silently).
        saved, now = state.get("data_position", {}), self._data_position()
        changed = [f"{k} {saved[k]} → {now[k]}" for k in now if k in saved and saved[k] != now[k]]
        if changed:
            logger.warning(f"resuming with {', '.join(changed)}: the data order and position differ from the run that "
                           "wrote the checkpoint")

    def _data_position(self) -> dict:
        return {"dataset_items": len(self.train_dataset), "seed": self.args.seed, "ranks": self.args.world_size,
                "micro_batches_per_step": self.args.gradient_accumulation_steps,
                "items_per_micro_batch": self.args.per_device_train_batch_size}

    # ---- once per optimizer step: non-finite values, stop requests ----

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._window_finite = torch.isfinite(loss).all() & self._window_finite  # no host sync per micro-batch
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        # The Trainer calls this once per optimizer step, after clipping and right before the update; the norm is the
        # global one (unscaled under fp16), so ranks agree on it. The loss flag is per rank: it joins one all-reduce.
        grad_norm = super()._get_grad_norm(model, grad_norm)
        norm = float(grad_norm) if grad_norm is not None else 0.0
        stop = self.stop_request is not None and self.stop_request.requested
        flags = torch.tensor([not math.isfinite(norm), not bool(self._window_finite), stop], dtype=torch.int32)
        self._window_finite = True
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags.to(self.args.device), reduction="sum").cpu()
        bad_grads, bad_loss, stop = (bool(f) for f in flags.tolist())
        if stop:  # this step completes; then the Trainer saves a checkpoint and leaves its loop
            self.control.should_save = self.control.should_training_stop = True
        self._skip_update, skipped, halt = nonfinite_verdict(bad_grads, bad_loss, self.args.fp16, self.on_nonfinite)
        if skipped:
            what = " and ".join(w for w, bad in (("the loss", bad_loss), ("the gradient norm", bad_grads)) if bad)
            what += f" {'are' if bad_loss and bad_grads else 'is'} not finite (grad_norm={norm})"
            step = self.state.global_step + 1
            if halt:
                raise NonFiniteError(
                    f"optimizer step {step}: {what}; stopped without updating or saving (train.on_nonfinite=stop). "
                    "Lower optim.lr, check the data, or set train.on_nonfinite=skip to skip such steps"
                )
            self.nonfinite_skipped += 1
            logger.warning(f"optimizer step {step}: {what}; no update ({self.nonfinite_skipped} skipped so far)")
        return grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and "grad_norm" in logs:
            logs["nonfinite_skipped"] = self.nonfinite_skipped
        super().log(logs, start_time)

    def create_optimizer(self, model=None):
        from finetune.optim import build_optimizer

        if self.optimizer is None:
            self.optimizer = build_optimizer(model if model is not None else self.model, self.optim_config, self.peak_lr)
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        from finetune.schedules import build_scheduler

        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, num_training_steps, self.schedule_config)
        return super().create_scheduler(num_training_steps, optimizer)
