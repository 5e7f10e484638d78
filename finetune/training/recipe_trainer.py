"""`RecipeTrainer`: what a recipe run trains with — `TokenNormTrainer` plus what a recipe asks of a whole run.

The recipe's optimizer and schedule (built at the Trainer's create_optimizer/create_scheduler), checkpoints that are
complete or absent and resume bitwise (checkpoints.py), non-finite values (train.on_nonfinite) and stop requests
(SIGTERM/SIGINT, lifecycle.py): non-finite values agreed on by all ranks once per optimizer step, a stop at the next
micro-batch with the unfinished window discarded (window_stop.py; under DeepSpeed at the window's end); evaluation
on the recipe's eval sets (finetune/evaluation/), the best model (best_model.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType
from transformers import PrinterCallback
from transformers.utils import logging

from finetune.core.trainer import TokenNormTrainer
from finetune.evaluation import metrics as eval_metrics
from finetune.evaluation.named_sets import evaluate_sets
from finetune.recipe import RecipeError
from finetune.training import (
    best_model,
    checkpoints,
    distributed,
    lifecycle,
    reporting,
    resume_checks,
    window_stop,
)
from finetune.training.nonfinite import NonFiniteError, nonfinite_verdict, read_back

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class StagingRoot:
    """The folder a checkpoint save writes checkpoint-N into (train.output_dir/.staging), handed to the Trainer's own
    `_save_checkpoint` as its trial: it reads its output folder from `_get_output_dir(trial)` and the trial nowhere
    else but to decide whether to store the FLOs (transformers 5.24)."""

    path: str


class RecipeTrainer(TokenNormTrainer):
    """What a recipe run trains with: TokenNormTrainer with the recipe's optimizer and schedule.

    Both are built at the Trainer's own hooks, so the optimizer sees the model as FSDP2/ZeRO wrap it, and the schedule
    gets the Trainer's count of optimizer steps (never micro-batches) and is stepped by the Trainer once per step.
    Checkpoints are complete or absent (finetune/training/checkpoints.py). Once per optimizer step, before
    the update, all ranks agree on whether the loss or gradients were non-finite (train.on_nonfinite: skip the update,
    counted as `nonfinite_skipped`, or stop). A stop request (SIGTERM/SIGINT) is honoured at the next micro-batch:
    the unfinished window is discarded and the last optimizer step saved (window_stop.py); one noticed at the window's
    last micro-batch (or under DeepSpeed, whose engine steps inside the last backward) completes the step first.
    Evaluation on the recipe's eval set (`eval_setup=`: its collator, an evaluation before the first step of a fresh
    run, perplexity and eval tokens/s per evaluation, the best model): finetune/evaluation/metrics.py.
    `merge_lora=True` (model.lora.merge): the final save and best/ are the merged model (finetune/model/lora_merge.py).
    `run_files`: what writes the run's files into every checkpoint-N and the final save (`files_of_run`: timings.jsonl,
    recipe.yaml). `reports`: the run's reporting callbacks (among `callbacks`); `eval_callbacks`: the evaluation's,
    added after `callbacks`; both held by name for what reads them (W&B's end-of-run figures, early stopping, the
    sample prompts).
    """

    def __init__(
        self,
        *args,
        optim_config,
        schedule_config,
        peak_lr: float,
        on_nonfinite: str = "skip",
        stop_request=None,
        data_order_change: str = "error",
        eval_setup: eval_metrics.EvalSetup | None = None,
        merge_lora: bool = False,
        activation_offloading: bool = False,
        run_files: Sequence = (),
        reports: reporting.RunReports | None = None,
        eval_callbacks: eval_metrics.EvalCallbacks | None = None,
        **kwargs,
    ):
        self.optim_config, self.schedule_config, self.peak_lr = optim_config, schedule_config, peak_lr
        self.on_nonfinite, self.stop_request = on_nonfinite, stop_request
        self.data_order_change = data_order_change  # train.resume_data_order_change: error | allow
        self.nonfinite_skipped = 0  # optimizer steps without an update: non-finite values, or fp16 GradScaler overflow
        self.eval_setup = eval_setup
        self.merge_lora = merge_lora  # model.lora.merge: the final save and best/ hold the merged model (lora_merge.py)
        self.activation_offloading = activation_offloading  # train.activation_offloading
        self.run_files = run_files  # each has files_for_checkpoint(): {file name: text}
        self.reports, self.eval_callbacks = reports, eval_callbacks  # held by name for what reads them
        self.eval_speeds: list[float] = []  # eval tokens/s of this process's evaluations
        self.window_start = window_stop.WindowStart()  # what a stop mid-window rewinds to
        self.stop_agreement: window_stop.StopAgreement | None = None  # made by train(): collective over the ranks
        if eval_callbacks is not None:
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or ()), *eval_callbacks.callbacks]
        super().__init__(*args, **kwargs)
        distributed.reduce_in_fp32()  # FSDP2 under bf16/fp16: before train() shards the model with the policy
        # StepProgress (finetune/training/reporting.py) prints one line per step instead of disable_tqdm's printer
        self.remove_callback(PrinterCallback)

    def _get_train_sampler(self, train_dataset=None):
        return checkpoints.epoch_seeded(super()._get_train_sampler(train_dataset), self.args.seed)

    # ---- checkpoints: complete or absent; a resume checked against the model before anything loads into it ----

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, str):
            checkpoints.check_same_model(resume_from_checkpoint, self.model)
            self.restore_checkpoint_state(checkpoints.read_state(resume_from_checkpoint))
        if self.stop_request is not None and self.stop_agreement is None and not self.decides_before_backward():
            self.stop_agreement = window_stop.StopAgreement.for_ranks(self.stop_request, self.accelerator.num_processes)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        if self.stop_agreement is not None:
            self.stop_agreement.finish()  # no sum left in flight when the process group ends
        return output

    def _run_epoch(self, *args, **kwargs):
        # Resumed from the run's last step in the middle of an epoch, transformers would train one step more (it
        # checks max_steps only after a step); a finished run trains nothing.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return None
        self.window_start.epoch_began()
        try:
            return super()._run_epoch(*args, **kwargs)
        except window_stop.WindowStopped:
            self.stop_mid_window(kwargs["model"], kwargs.get("trial"), kwargs["num_update_steps_per_epoch"])
            return None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.window_start.window_opened()
        return batches

    def stop_mid_window(self, model, trial, steps_per_epoch: int) -> None:
        """All ranks agreed on a stop before a micro-batch: nothing of this window is applied (its gradients are
        dropped; no optimizer or scheduler step), and the checkpoint of the last optimizer step is saved with the
        generators as the resumed run meets this window again (window_stop.py)."""
        self.stop_request.join()
        model.zero_grad(set_to_none=True)
        self.verdict.take_window_finite()
        step = self.state.global_step
        # A resume restores the generators at the epoch's start when it starts at the epoch's first window
        self.window_start.rewind(first_of_epoch=self.args.ignore_data_skip or step % steps_per_epoch == 0)
        if self.window_start.tr_loss is not None:  # the logged loss and FLOs without this window's micro-batches
            self._tr_loss.copy_(self.window_start.tr_loss)
        self.current_flos = self.window_start.flos
        done, total = self.window_start.micro_batches - 1, self.current_gradient_accumulation_steps
        reporting.main_print(
            f"{self.stop_request.signal_name}: optimizer step {step + 1} stopped after {done} of its {total} "
            "micro-batches; nothing of it is applied (a resume runs it again)"
        )
        self.control.should_training_stop = True
        if step == 0:  # nothing trained: no checkpoint, a resume starts afresh
            return
        self.control.should_save = True
        self._save_checkpoint(model, trial)
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _save_checkpoint(self, model, trial):  # staged, then renamed into place: complete or absent
        checkpoints.save_atomically(
            self, lambda root: self.save_checkpoint_into(root, model, trial), self.files_of_run()
        )

    def files_of_run(self) -> dict[str, str]:
        """{file name: text} of the run's own files (`run_files`): into every checkpoint-N and the final save."""
        return {name: text for source in self.run_files for name, text in source.files_for_checkpoint().items()}

    def save_checkpoint_into(self, root: str, model, trial) -> None:
        """The Trainer's own checkpoint save (root/checkpoint-N: weights, optimizer, RNG, trainer state; rotation in
        root) with `root` in place of train.output_dir. The Trainer takes that folder from `_get_output_dir(trial)`,
        so `root` travels down as the trial it is given (`StagingRoot`)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # what the Trainer's save does for a trial of None, which it is not given here
        super()._save_checkpoint(model, StagingRoot(root))

    def _get_output_dir(self, trial):
        return trial.path if isinstance(trial, StagingRoot) else super()._get_output_dir(trial)

    def _save_rng_state(self, output_dir):
        # plain tensors and ints, so the file loads with torch.load(weights_only=True)
        os.makedirs(output_dir, exist_ok=True)
        torch.save(checkpoints.rng_state(), os.path.join(output_dir, self._rng_file()))

    def _load_rng_state(self, checkpoint):
        if checkpoint is not None:
            checkpoints.restore_rng_state(checkpoint, self._rng_file())
            self.window_start.epoch_began()  # restored at the epoch's start: what a stop in its first window saves

    def _issue_warnings_after_load(self, load_result) -> None:
        # a tied head (lm_head.weight, embed_tokens.weight) is saved once: not a missing key of the checkpoint
        missing = checkpoints.tied_missing(self.model, load_result.missing_keys)
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _rng_file(self) -> str:
        return checkpoints.rng_file(self.args.world_size, self.args.process_index)

    def _load_optimizer_and_scheduler(self, checkpoint):
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except (ValueError, RuntimeError, KeyError) as e:
            raise checkpoints.optimizer_state_error(checkpoint, e) from None

    def checkpoint_state(self) -> dict:
        return {"nonfinite_skipped": self.nonfinite_skipped, "data_position": self._data_position()}

    def restore_checkpoint_state(self, state: dict) -> None:
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
        # The Trainer skips global_step × accumulation micro-batches into the epoch: the same position only if these
        # agree (another data.limit, seed or number of ranks resumes somewhere else, silently).
        saved, now = state.get("data_position", {}), self._data_position()
        changed = resume_checks.position_changes(saved, now)
        if changed and self.data_order_change != "allow":
            keys = resume_checks.changed_keys(saved, now)
            raise RecipeError(
                f"train.resume_from: resuming with {', '.join(changed)} would train on another data order and position "
                f"than the run that wrote the checkpoint; set {keys} as that run had them, or set "
                "train.resume_data_order_change=allow to continue anyway"
            )
        if changed:
            logger.warning(
                f"resuming with {', '.join(changed)}: the data order and position differ from the run that "
                "wrote the checkpoint"
            )

    def _data_position(self) -> dict:
        return resume_checks.data_position(self)  # len() of a stream: it has none

    # ---- stop requests at each micro-batch; non-finite values once per optimizer step ----

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.window_start.micro_batch(self)
        if self.stop_agreement is not None and self.stop_agreement.agreed():  # before the forward: DDP is idle
            raise window_stop.WindowStopped
        loss = super().training_step(model, inputs, num_items_in_batch)
        finite = self.verdict.note_loss(loss)  # no host sync per micro-batch
        # Trainer's NaN filter is off (it reads the loss back after every backward): a non-finite micro-batch adds 0
        # to the logged loss instead, so later steps' logs stay finite; its step is vetoed and counted anyway
        return torch.where(finite, loss, torch.zeros_like(loss))

    def decides_before_backward(self) -> bool:
        """Whether the step's verdict is taken before the window's last backward: under DeepSpeed, whose engine.step()
        runs inside that backward (accelerate's DeepSpeedEngineWrapper), before the Trainer's grad-norm hook."""
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if (
            self.decides_before_backward()
            and model.training
            and torch.is_grad_enabled()
            and self.accelerator.sync_gradients
        ):  # the window's last micro-batch, before its backward
            loss = result[0] if return_outputs else result
            stop = self.stop_request is not None and self.stop_request.requested
            flags = torch.tensor(
                [not bool(torch.isfinite(loss).all() & self.verdict.window_finite), stop], dtype=torch.int32
            )
            if self.accelerator.num_processes > 1:
                flags = self.accelerator.reduce(flags.to(self.args.device), reduction="sum").cpu()
            bad_loss, stop = (bool(f) for f in flags.tolist())
            self._judge(False, bad_loss, stop, "not known before the step")
        return result

    def _get_grad_norm(self, model, grad_norm=None):
        # The Trainer calls this once per optimizer step, after clipping and right before the update; the norm is the
        # global one (unscaled under fp16), so ranks agree on it. The loss flag is per rank: it joins one all-reduce.
        grad_norm = super()._get_grad_norm(model, grad_norm)
        norm = 0.0 if grad_norm is None else grad_norm
        if self.decides_before_backward():  # the loss and stop request were judged before the last backward
            self.verdict.take_window_finite()  # the next step's verdict is taken anew before its own backward
            (norm,) = read_back(norm)
            if not math.isfinite(norm) and not self.verdict.nonfinite:  # a finite loss with non-finite gradients: fp16
                self._judge(True, False, False, norm)  # DeepSpeed's loss scaler skipped it; bf16 DeepSpeed applied it
            return grad_norm
        # the step's one host read: the norm and the window's finite flag together
        norm, window_finite = read_back(norm, self.verdict.take_window_finite())
        stop = self.stop_request is not None and self.stop_request.requested
        flags = torch.tensor([not math.isfinite(norm), not window_finite, stop], dtype=torch.int32)
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags.to(self.args.device), reduction="sum").cpu()
        bad_grads, bad_loss, stop = (bool(f) for f in flags.tolist())
        self._judge(bad_grads, bad_loss, stop, norm)
        return grad_norm

    def _judge(self, bad_grads: bool, bad_loss: bool, stop: bool, norm) -> None:
        """This step's verdict from flags all ranks agree on: veto the update, count a skip, or stop."""
        if stop:  # this step completes; then the Trainer saves a checkpoint and leaves its loop
            self.stop_request.join()
            self.control.should_save = self.control.should_training_stop = True
        self.verdict.nonfinite, skipped, halt = nonfinite_verdict(
            bad_grads, bad_loss, self.args.fp16, self.on_nonfinite
        )
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

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and "grad_norm" in logs:
            logs["nonfinite_skipped"] = self.nonfinite_skipped
        evaluated = self.eval_setup is not None and "eval_loss" in logs
        if evaluated:
            for key in [k for k in logs if k.startswith("eval_") and k.endswith("_loss")]:  # each set's, and all
                logs[key.removesuffix("_loss") + "_perplexity"] = eval_metrics.perplexity(logs[key])
            if logs.get("eval_runtime"):
                logs["eval_tokens_per_s"] = self.eval_setup.tokens / logs["eval_runtime"]
                self.eval_speeds.append(logs["eval_tokens_per_s"])
        super().log(logs, start_time)
        if evaluated:  # callbacks saw them; the saved history keeps what a resumed run reproduces
            for key in eval_metrics.EVAL_TIMING_KEYS:
                self.state.log_history[-1].pop(key, None)

    # ---- evaluation on the recipe's eval set ----

    def _get_collator_with_removed_columns(self, data_collator, description=None):
        # The Trainer's dataloaders take their collator from here (the eval sets are MicroBatches, not
        # datasets.Dataset): evaluation batches with the eval set's own collator.
        if self.eval_setup is not None and description == "Evaluation":
            data_collator = self.eval_setup.collator
        return super()._get_collator_with_removed_columns(data_collator, description)

    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler: bool = False):
        # skip_scheduler: the Trainer's evaluation before the first step (eval_on_start). A step above 0 there: resumed
        # from a checkpoint, whose log history holds that evaluation already.
        if skip_scheduler and self.state.global_step > 0:
            return {}
        return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        try:
            if eval_dataset is None and isinstance(self.eval_dataset, dict):  # named eval sets: one evaluation
                metrics = evaluate_sets(self, self.eval_dataset, ignore_keys, metric_key_prefix)
                self.log(metrics)
                self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
                return metrics
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        except lifecycle.EvaluationStopped:  # a stop request mid-evaluation: nothing logged, the checkpoint comes next
            return {}

    def _determine_best_metric(self, metrics, trial) -> bool:
        if not metrics:  # an evaluation a stop request ended
            return False
        new_best = super()._determine_best_metric(metrics, trial)
        if new_best and self.eval_setup is not None:
            self.state.best_global_step = self.state.global_step  # the Trainer records it only when saving by steps
            if self.eval_setup.keep_best:
                with self.meter.paused():  # training tokens/s skip the save
                    best_model.save_best(self)
        return new_best

    def compute_loss_context_manager(self):
        """The forward's context (autocast); with train.activation_offloading also torch's save_on_cpu: every tensor
        autograd saves in the forward (under gradient checkpointing: each checkpointed block's inputs) is copied to
        host memory (pinned on a GPU) and back in backward. The same values, so the same gradients bitwise."""
        stack = super().compute_loss_context_manager()
        if self.activation_offloading and torch.is_grad_enabled():
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()))
        return stack

    def create_optimizer(self, model=None):
        from finetune.training.optim import build_optimizer

        if self.optimizer is None:
            trained = model if model is not None else self.model
            self.optimizer = build_optimizer(
                trained, self.optim_config, self.peak_lr, grad_scaled=self.accelerator.scaler is not None
            )
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        from finetune.training.schedules import build_scheduler

        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, num_training_steps, self.schedule_config)
        return super().create_scheduler(num_training_steps, optimizer)
