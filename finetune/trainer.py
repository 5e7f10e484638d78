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
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import logging

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
        if chunked and self._chunked_head is None and inputs["logits_to_keep"].any():
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
        # The chunked loss uses the head's weight outside the model's forward: FSDP has resharded it by then, and DDP
        # searching for unused parameters would count it unused and then see its gradient arrive (ready twice).
        if self.is_fsdp_enabled or getattr(model, "find_unused_parameters", False):
            return None
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
