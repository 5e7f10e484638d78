"""`TokenNormTrainer`: a drop-in `transformers.Trainer` whose gradient and eval loss are exact token means.

What it improves over `Trainer`, and nothing else (everything else is `Trainer`'s own code path):

- **Training**: per optimizer step the whole accumulation window's label tokens are counted (with the mask of the
  model's loss kind, summed over data-parallel ranks only: `window_label_tokens`), and each micro-batch's loss is the
  *sum* of cross-entropy computed here from the model's logits (the model's own loss is never used, so models that
  ignore `num_items_in_batch`, like many VLMs, are exact too), divided by that count, times the data-parallel size:
  the rule and why each factor is there are in finetune/core/token_mean.py, which these hooks call. Label smoothing
  (`label_smoothing_factor`) is applied inside the sum; a `compute_loss_func` gets the window count as
  `num_items_in_batch`.
- **A mixture of experts' router balancing loss** (the `aux_loss` its forward returns where its config asks for it)
  stays in the objective, weighted by its `router_aux_loss_coef` as the model weighs it, and averaged over the
  window's micro-batches and ranks (`token_mean.balance_share`): the weight the user set, where `Trainer` multiplies
  it by the accumulation steps. The eval loss is the language-model loss alone.
- **Evaluation**: `evaluate()`/`predict()`'s `eval_loss` is the token mean of the whole eval set (every labelled
  position's loss summed over all batches and ranks ÷ their count, logged as `eval_label_tokens`), not a mean of
  per-batch means: it does not move with the eval batch size, the last short batch or the number of ranks.
  `eval_token_accuracy` is the share of those positions whose argmax is the label.
- **Right padding** without targets trains unmasked in transformers' causal LMs (exact: heads.py `ForwardTakes`).
- **An empty window** (no labelled token on any rank) makes no update (`updates_weights`), instead of moving the
  weights by optimizer momentum and decay, whatever built the optimizer (the gate is hooked onto it at the first
  window).
- **A loss from elsewhere** (a subclass's `compute_loss` that does not call this one) is trained by `Trainer`'s own
  rule for it, with one warning (`finetune/core/step_verdict.py` keeps what decides each step); `require_exact=True`
  raises instead.
- **Per-step figures**: `window_label_tokens`, `padding_efficiency`, `mean_sequence_tokens`, `clip_factor` in the log
  history; tokens/s, samples/s, peak memory and MFU go to every `on_log` callback (console, W&B), not to
  `trainer_state.json`, whose log history a resumed run reproduces exactly.

Which loss applies, and when `Trainer`'s own rule takes over, is decided in finetune/core/loss_choice.py; the LM
head run chunk by chunk on the kept hidden states lives in finetune/core/chunked_head.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Trainer
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import logging

from finetune.core import token_mean
from finetune.core.causal_forward import foreign_forward, own_forward
from finetune.core.chunked_head import ChunkedHead
from finetune.core.heads import (
    aux_loss_of,
    forward_takes,
    logits_of,
    plain_head,
    problem_type_of,
    unplaced_loss_fields,
)
from finetune.core.loss import (
    IGNORE_INDEX,
    SAMPLE,
    SEQ2SEQ,
    cross_entropy_sum,
    kept_cross_entropy_sum,
    row_correct_counts,
    row_cross_entropy_sums,
    sample_loss_sums,
    scalar_loss_of_func,
    targets_of,
)
from finetune.core.loss_choice import (
    aux_loss_line,
    choose_loss,
    empty_window_line,
    eval_loss_not_exact_line,
    foreign_loss_line,
    misaligned_logits_line,
    unplaced_loss_line,
)
from finetune.core.meter import (
    TIMING_KEYS,
    RouterMeter,
    WindowMeter,
    compute_precision,
    device_peak_flops,
    matmul_parameters,
    model_flops_utilisation,
    window_counts,
)
from finetune.core.router_balance import experts_of, layer_counts, probability_sums, routing_counts, window_share
from finetune.core.router_weight import balance_coefficient, coefficient_key
from finetune.core.step_verdict import StepGate, StepVerdict

logger = logging.get_logger(__name__)


class TokenNormTrainer(Trainer):
    """`transformers.Trainer` with exact token-mean gradients and eval loss (see the module docstring).

    Same constructor as `Trainer`, plus `peak_flops` (the device's peak FLOP/s for MFU; default: a table of GPUs) and
    `require_exact` (True: where this trainer would fall back to `Trainer`'s own loss, it raises instead).
    """

    def __init__(
        self,
        *args,
        peak_flops: float | None = None,
        require_exact: bool = False,
        moe_balance: str = "micro",
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.require_exact = require_exact
        if moe_balance not in ("micro", "window"):
            raise ValueError(f"moe_balance={moe_balance!r}: micro (each micro-batch's) or window (the whole window's)")
        self.moe_balance = moe_balance  # a mixture of experts' router balancing loss: per micro-batch or per window
        if self.get_cp_size() > 1 or self.get_sp_size() > 1:
            raise NotImplementedError(
                "TokenNormTrainer computes the loss from full-sequence logits; context/sequence parallelism shards "
                "the sequence. Use data parallelism (DDP, FSDP, ZeRO) or tensor parallelism."
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.loss_kind = self._decide_loss_kind(unwrap_peft_model(unwrapped))
        # A forward another library put in place of transformers' (Liger's lce_forward): its kernels stay, the causal
        # LM forward is transformers' own again where it can be (finetune/core/causal_forward.py)
        replaced = own_forward(unwrap_peft_model(unwrapped)) if self.loss_kind is not None else None
        if replaced is not None:
            logger.warning(f"TokenNormTrainer: {replaced}")
        self.forward_takes = forward_takes(unwrapped)  # labels, a KV cache, logits_to_keep
        # Logits only where a target is: prompt and padding positions never reach the LM head (most of the FLOPs and
        # memory of a small model with a large vocabulary); not through a forward another library put in place.
        keeps_logits = self.forward_takes.logits_to_keep and foreign_forward(unwrap_peft_model(unwrapped)) is None
        # With kept positions, the LM head and cross-entropy run chunk by chunk on hidden states once the first
        # training forward has shown that the model allows it (finetune/core/chunked_head.py); under mixed precision
        # its GEMMs take the autocast dtype, as the model's own head would.
        head_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision)
        self.chunked_head = ChunkedHead(keeps_logits, head_dtype if self.accelerator.native_amp else None)
        self.verdict = StepVerdict()  # what decides each optimizer step (finetune/core/step_verdict.py)
        self._foreign_loss_said = False
        # token_mean.EVAL_COLUMNS summed over the set while an evaluation loop runs (see evaluating())
        self._eval_sums: torch.Tensor | None = None
        # every optimizer step consults updates_weights() (finetune/core/step_verdict.py)
        self.step_gate = StepGate(self.updates_weights, self._say_why_not_updated)
        self.meter = WindowMeter()  # what the windows held and how fast they went: the step logs, the end-of-run table
        self.router_meter = RouterMeter()  # a mixture of experts: its balancing term and each layer's expert load
        # MFU is logged where the device's peak is known (a table of GPUs) or given.
        self.peak_flops = peak_flops or device_peak_flops(compute_precision(self.args.bf16, self.args.fp16, self.model))
        self._matmul_params: int | None = None

    def _decide_loss_kind(self, model) -> str | None:
        """The loss this trainer computes for `model` and these arguments (finetune/core/loss_choice.py), or None:
        then `Trainer`'s own loss (or a base class's), unchanged, with one warning."""
        choice = choose_loss(type(self), TokenNormTrainer, model, self.args)
        if choice.fallback is not None:
            self._fall_back(choice.fallback)
        if choice.note is not None:
            logger.warning(choice.note)
        return choice.kind

    def _fall_back(self, message: str) -> None:
        """Where exactness is impossible: one warning and `Trainer`'s own behaviour, or with require_exact an error."""
        if self.require_exact:
            raise ValueError(message + " (require_exact=True: refused)")
        logger.warning(message)

    @property
    def loss_is_scaled_for_ga(self) -> bool | None:
        # Our compute_loss divided this micro-batch's sum by the whole window's label tokens: the Trainer must not
        # divide by accumulation again. A loss from elsewhere gets the Trainer's own rule (None).
        return True if self.loss_kind is not None and self.verdict.micro_batch_loss_ours else None

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.verdict.begin_micro_batch()
        self.chunked_head.hold_positions(*self._host_targets(inputs), self._prepare_input)
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.chunked_head.hold_positions(None, False, False, self._prepare_input)
        if self.verdict.end_micro_batch() and self.loss_kind is not None and not self._foreign_loss_said:
            self._foreign_loss_said = True
            self._fall_back(foreign_loss_line(type(self)))
        return loss

    def _host_targets(self, inputs) -> tuple[torch.Tensor | None, bool, bool]:
        """(a micro-batch's targets where its labels are still on the host and the loss is ours, else None; whether
        its labels are pinned; whether its forward may leave out the mask of its right padding: ForwardTakes)."""
        labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
        if not isinstance(labels, torch.Tensor) or self.loss_kind is None or self.compute_loss_func is not None:
            return None, False, False
        targets = targets_of(inputs, self.loss_kind)
        return targets, labels.is_pinned(), self.forward_takes.unmasks_right_padding(inputs, targets)

    def _data_parallel_size(self) -> int:
        # Tensor-parallel ranks hold replicas of one batch; only data-parallel ranks see different data.
        return self.accelerator.num_processes // self.get_tp_size()

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        # A prefetched window holds K micro-batches: keep them on the host (pinned on a GPU machine) until their turn;
        # training_step moves each one to the device as it runs.
        if self.loss_kind is not None and getattr(dataloader, "device", None) is not None:
            dataloader.device = None
        return dataloader

    def _prepare_input(self, data):
        # The window's micro-batches wait on the host (pinned on a GPU machine): copied without blocking the host, so
        # the copy of micro-batch k + 1 does not wait for the backward of micro-batch k.
        if (
            isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and self.args.device.type == "cuda"
            and (data.is_pinned() and not self.is_deepspeed_enabled)
        ):
            return data.to(self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    # ---- window: count targets over all data-parallel ranks ----

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.loss_kind is None:
            self.verdict.window_batches = None  # Trainer's own count, from Trainer's own get_batch_samples
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if not self.is_deepspeed_enabled:  # whatever built it: an override, the constructor's optimizers=
            self.step_gate.hook_onto(self.optimizer)
        if not batch_samples or not all(isinstance(b, Mapping) and "labels" in b for b in batch_samples):
            self.verdict.open_window(None)
            return batch_samples, self._get_num_items_in_batch(batch_samples, device)
        # Counted on the host, where the window waits; with several processes one all-reduce per window for every
        # count (label tokens first; tensor-parallel ranks hold replicas) and one read back: the step's one count sync.
        counts = window_counts(batch_samples, self.loss_kind)
        if self.accelerator.num_processes > 1:
            reduced = self.accelerator.reduce(torch.tensor(counts, dtype=torch.int64, device=device), reduction="sum")
            counts = (reduced // self.get_tp_size()).tolist()
        self.meter.add(counts)
        self.verdict.open_window(counts[0], batch_samples)
        self.router_meter.open_window()
        if self.moe_balance == "window":
            self.verdict.window_routing = self._window_routing(batch_samples)
        return batch_samples, counts[0]

    def _window_routing(self, batch_samples) -> torch.Tensor | None:
        """moe_balance="window": the routing of every micro-batch of the window, before its first backward (a
        no-grad forward of each, as training will run it), summed over the data-parallel ranks
        (finetune/core/router_balance.py); None for a model without a router balancing loss."""
        model = unwrap_peft_model(self.accelerator.unwrap_model(self.model))
        shape = experts_of(model)
        if shape is None or balance_coefficient(model) is None:
            return None
        counts = None
        with torch.no_grad(), self.compute_loss_context_manager():
            for batch in batch_samples:
                forward = self.forward_takes.inputs(model, self._prepare_inputs(batch), False)
                if self.forward_takes.logits_to_keep:
                    forward["logits_to_keep"] = 1  # the routing is wanted, not the logits
                outputs = self.model(**forward, output_router_logits=True)
                routed = routing_counts(outputs.router_logits, forward.get("attention_mask"), *shape)
                counts = routed if counts is None else counts + routed
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum") / self.get_tp_size()
        return counts

    # ---- loss: sum from the logits, divided by the window's count ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_kind is None or not isinstance(inputs, Mapping) or "labels" not in inputs:
            return self._trainers_loss(model, inputs, return_outputs, num_items_in_batch)
        targets = targets_of(inputs, self.loss_kind)
        if self.compute_loss_func is not None:
            return self._loss_of_func(model, inputs, targets, return_outputs, num_items_in_batch)
        keep_logits = self.chunked_head.keeps_logits and not return_outputs
        outputs, loss_sum, label_tokens = self._summed_loss(model, inputs, targets, keep_logits)
        if loss_sum is None:  # its logits do not line up with the collator's labels: Trainer's own loss from now on
            self._defer_to_trainer(model, outputs, targets)
            return self._trainers_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.evaluating() or num_items_in_batch is None:  # this batch's own token mean (evaluation, a direct call)
            loss = token_mean.batch_mean(loss_sum, label_tokens)
        else:  # num_items_in_batch: the window's label tokens, from get_batch_samples (finetune/core/token_mean.py)
            loss = token_mean.window_loss(loss_sum, num_items_in_batch, self._data_parallel_size())
            if (added := self._added_terms(model, outputs, inputs)) is None:  # terms this trainer cannot place
                self.loss_kind = None  # every hook now takes Trainer's own path
                return self._trainers_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = loss + added
            self.verdict.loss_is_ours()
        return (loss, outputs) if return_outputs else loss

    def _trainers_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        """Trainer's own loss. Where it took over inside a window this trainer counted (a model found to add a term,
        or to re-align its labels), the window's count is Trainer's own rule's too, so that the window trains as
        Trainer trains it."""
        window = self.verdict.window_batches
        if self.loss_kind is None and window is not None and num_items_in_batch is not None:
            if self.verdict.trainers_count is None:
                device = getattr(num_items_in_batch, "device", self.args.device)
                self.verdict.trainers_count = self._get_num_items_in_batch(window, device)
            num_items_in_batch = self.verdict.trainers_count
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _added_terms(self, model, outputs, inputs: Mapping) -> torch.Tensor | float | None:
        """What the model's own forward adds to the token mean: a mixture of experts' router balancing loss (its
        share, kept), 0 where nothing, or None (one warning said) where it adds a term this trainer cannot place."""
        unwrapped = self.accelerator.unwrap_model(model)
        name = type(unwrapped).__name__
        if fields := unplaced_loss_fields(outputs):
            self._fall_back(unplaced_loss_line(name, fields))
            return None
        if (aux := aux_loss_of(outputs)) is None:
            return 0.0
        if (coefficient := balance_coefficient(unwrapped)) is None:  # a router loss without the weight it is added by
            self._fall_back(aux_loss_line(name, coefficient_key(unwrapped)))
            return None
        return self._balance_share(aux, coefficient, outputs, inputs)

    def _balance_share(self, aux: torch.Tensor, coefficient: float, outputs, inputs: Mapping) -> torch.Tensor:
        """This micro-batch's share of the router balancing loss: of the whole window's (moe_balance="window"), else
        of the mean of each micro-batch's own (finetune/core/token_mean.py, router_balance.py)."""
        routing, mask = self.verdict.window_routing, inputs.get("attention_mask")
        if self.moe_balance == "window" and routing is not None:
            sums = probability_sums(outputs.router_logits, mask)
            share = window_share(sums, routing, coefficient, self._data_parallel_size())
        else:
            share = token_mean.balance_share(aux, coefficient, self.verdict.window_micro_batches)
        experts = experts_of(unwrap_peft_model(self.accelerator.unwrap_model(self.model)))
        if experts is not None and getattr(outputs, "router_logits", None) is not None:  # the ranks' mean of the
            self.router_meter.add(share, layer_counts(outputs.router_logits, mask, *experts))  # summed shares: the term
        return share

    def _loss_of_func(self, model, inputs, targets, return_outputs, num_items_in_batch):
        """A `compute_loss_func` divides its own sum by the count it is given: the window's (training) or the batch's
        (evaluation); the data-parallel factor of token_mean.window_loss is applied here."""
        outputs, _, _ = self._forward(model, inputs, targets, keep_logits=False)
        label_tokens = (targets != IGNORE_INDEX).sum()
        per_batch = self.evaluating() or num_items_in_batch is None
        loss = self.compute_loss_func(
            outputs, inputs["labels"], num_items_in_batch=label_tokens if per_batch else num_items_in_batch
        )
        loss = scalar_loss_of_func(loss)
        if self.evaluating():
            self._add_eval(self.accelerator.gather(token_mean.eval_rows(loss.double() * label_tokens, label_tokens)))
        elif not per_batch:
            loss = loss * self._data_parallel_size()
            self.verdict.loss_is_ours()
        return (loss, outputs) if return_outputs else loss

    def _summed_loss(self, model, inputs: Mapping, targets: torch.Tensor, keep_logits: bool):
        """(outputs, summed loss, label tokens) of one micro-batch: through the chunked head where the model allows
        it, else from its (kept) logits; an evaluation also adds its rows to the set's sums."""
        smoothing = self.args.label_smoothing_factor
        outputs, hidden, index = self._forward(model, inputs, targets, keep_logits=keep_logits)
        logits = logits_of(outputs)
        kept = keep_logits and logits is not None and logits.dim() == 2
        full = logits is not None and logits.shape[:-1] == targets.shape
        if hidden is not None:
            loss_sum, count = self.chunked_head.loss_sum(hidden, targets, smoothing, index)
        elif self.loss_kind == SAMPLE and logits is not None and logits.shape[0] == targets.shape[0]:
            problem = problem_type_of(self.accelerator.unwrap_model(model), targets)
            loss_sum, count = self._summed_rows(*sample_loss_sums(logits, targets, problem, smoothing))
        elif self.evaluating() and (kept or full):
            row_sums, row_counts = row_cross_entropy_sums(logits, targets, smoothing)
            loss_sum, count = self._summed_rows(row_sums, row_counts, row_correct_counts(logits, targets))
        elif kept:
            loss_sum, count = kept_cross_entropy_sum(logits, targets, smoothing)
        elif full:
            loss_sum, count = cross_entropy_sum(logits, targets, smoothing)
        else:  # nothing that lines up with the labels (a model that re-aligns them itself): compute_loss defers
            return outputs, None, None
        return outputs, loss_sum, count

    def _defer_to_trainer(self, model, outputs, targets: torch.Tensor) -> None:
        """A model whose logits do not line up with the collator's labels (one that splices positions into the
        sequence and re-aligns the labels inside its forward) is trained and evaluated by Trainer's own loss from here
        on, as Trainer would train it: one warning (an error with require_exact)."""
        logits = logits_of(outputs)
        name = type(self.accelerator.unwrap_model(model)).__name__
        shape = None if logits is None else tuple(logits.shape)
        self._fall_back(misaligned_logits_line(name, self.loss_kind, shape, tuple(targets.shape)))
        self.loss_kind = None  # every hook now takes Trainer's own path

    def _summed_rows(self, row_sums: torch.Tensor, row_counts: torch.Tensor, correct: torch.Tensor | None = None):
        """(loss sum, count) of a batch from per-row figures; an evaluation also adds the rows to the whole set's
        sums. gather_for_metrics drops the rows repeated to fill the last batches, even where a subclass gathers
        predictions with plain gather (Seq2SeqTrainer keeps them)."""
        if self.evaluating():
            self._add_eval(self.accelerator.gather_for_metrics(token_mean.eval_rows(row_sums, row_counts, correct)))
        return row_sums.sum(), row_counts.sum()

    def _forward(self, model, inputs: Mapping, targets: torch.Tensor, keep_logits: bool):
        """(model outputs, the kept positions' hidden states where the chunked head computes the loss, else None, the
        flat positions they were taken from where known on the host, else None). One forward per micro-batch."""
        forward = self.forward_takes.inputs(self.accelerator.unwrap_model(model), inputs, self.loss_kind == SEQ2SEQ)
        if not keep_logits:
            return model(**forward), None, None
        forward["logits_to_keep"] = targets != IGNORE_INDEX
        if not torch.is_grad_enabled() or self.chunked_head.head is False:
            return model(**forward), None, None
        return self.chunked_head.forward(model, forward, targets, lambda: self._head_for_chunks(model))

    def _head_for_chunks(self, model) -> torch.nn.Linear | None:
        """The LM head the chunked loss may use outside the model's forward: not under FSDP (resharded by then), nor
        under DDP searching for unused parameters (it would count the head unused, then see its gradient arrive)."""
        if self.is_fsdp_enabled or getattr(model, "find_unused_parameters", False):
            return None
        return plain_head(unwrap_peft_model(self.accelerator.unwrap_model(model)))

    # ---- evaluation: the token mean of the whole set ----

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Only the loss is asked for (evaluate() without compute_metrics): logits where a target is, not [B, T, V]
        if (
            not prediction_loss_only
            or self.loss_kind is None
            or self.compute_loss_func is not None
            or not isinstance(inputs, Mapping)
            or inputs.get("labels") is None
        ):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluate(self, *args, **kwargs):
        with self.meter.paused():  # the step meter's clock skips the evaluation: training tokens/s stay training's
            return super().evaluate(*args, **kwargs)

    def evaluating(self) -> bool:
        """Whether an evaluation loop is running: compute_loss then reports each batch's own token mean and adds its
        rows to the whole set's sums (finetune/core/token_mean.py)."""
        return self._eval_sums is not None

    def _add_eval(self, gathered: torch.Tensor) -> None:
        self._eval_sums += gathered.to(self._eval_sums.device, torch.float64).sum(0)

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        if self.loss_kind is None:
            return super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        self._eval_sums = torch.zeros(len(token_mean.EVAL_COLUMNS), dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
            totals = dict(zip(token_mean.EVAL_COLUMNS, self._eval_sums.tolist()))
        finally:
            self._eval_sums = None
        deferred = self.loss_kind is None  # the model turned out to re-align its labels: said once, at the switch
        if not deferred and totals["rows"] == 0 and f"{metric_key_prefix}_loss" in output.metrics:
            logger.warning_once(eval_loss_not_exact_line(metric_key_prefix, type(self).__name__))
        elif not deferred:  # every rank gathered every row: the same figures everywhere
            output.metrics.update(token_mean.eval_metrics(list(totals.values()), metric_key_prefix))
        return output

    # ---- the optimizer step consults updates_weights() ----

    def updates_weights(self) -> bool:
        """Whether this optimizer step may change the weights: not for a window without any labelled token (its zero
        gradient would still move AdamW's moments and decay the weights). Subclasses add their reasons (and super)."""
        return self.verdict.updates_weights()

    def _say_why_not_updated(self) -> None:
        if self.verdict.window_label_tokens == 0:
            logger.warning(empty_window_line(self.state.global_step + 1))

    def create_optimizer(self, model=None):
        # Under DeepSpeed the engine wraps this optimizer (and steps it inside the last backward): gated here, before.
        optimizer = super().create_optimizer(model)
        self.step_gate.hook_onto(optimizer)
        return optimizer

    # ---- logging ----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        timing = ()
        if self.loss_kind is not None and "loss" in logs and "grad_norm" in logs:  # an optimizer-step line
            logs.update(self.meter.drain())
            logs.update(self.router_meter.drain(self.accelerator))
            if self.peak_flops and logs.get("real_tokens_per_s"):
                model = self.accelerator.unwrap_model(self.model)
                if self._matmul_params is None:
                    self._matmul_params = matmul_parameters(model)
                job_peak = self.peak_flops * self.accelerator.num_processes  # the token rate is the whole job's
                logs["mfu"] = model_flops_utilisation(model, logs, self._matmul_params, job_peak)
            if self.args.max_grad_norm > 0 and logs["grad_norm"] is not None:
                logs["clip_factor"] = min(1.0, self.args.max_grad_norm / (logs["grad_norm"] + 1e-6))
            timing = [key for key in TIMING_KEYS if key in logs]
        super().log(logs, start_time)
        for key in timing:  # callbacks saw them; the saved history keeps what a resumed run reproduces
            self.state.log_history[-1].pop(key, None)
