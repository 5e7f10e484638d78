"""The `TrainingArguments` a recipe trains with: each recipe section gives its own keys (train, optim, log, data, eval);
what the Trainer would otherwise do on its own (report to W&B, draw tqdm, filter NaN losses) is turned off where the
recipe trainer does it itself."""

from __future__ import annotations

from transformers import TrainingArguments

from finetune.recipe import DataConfig, EvalConfig, LogConfig, OptimConfig, RunPlan, TrainConfig
from finetune.training import distributed, reporting


def train_keys(train: TrainConfig, accumulation: int) -> dict:
    return dict(
        output_dir=train.output_dir,
        gradient_accumulation_steps=accumulation,
        max_steps=train.max_steps,
        num_train_epochs=train.epochs,
        max_grad_norm=train.max_grad_norm,
        bf16=train.precision == "bf16",
        fp16=train.precision == "fp16",
        seed=train.seed,
        save_strategy="steps" if train.save_steps > 0 else "no",
        save_steps=max(train.save_steps, 1),
        save_total_limit=train.save_total_limit,
        activation_checkpointing=train.gradient_checkpointing,
        # RecipeTrainer judges every window's loss without a host sync (train.on_nonfinite); Trainer's filter would
        # read the loss back after every backward, draining the GPU's queue once per micro-batch
        logging_nan_inf_filter=False,
    )


def log_keys(log: LogConfig, run_name: str) -> dict:
    return dict(
        logging_steps=log.every_steps,
        report_to=[],  # W&B through reporting.RecipeWandbCallback (the recipe as run config)
        disable_tqdm=True,  # reporting.StepProgress draws the bar and one line per step
        run_name=run_name,
    )


def data_keys(data: DataConfig, per_device_batch_size: int, group_by_length: bool) -> dict:
    return dict(
        per_device_train_batch_size=per_device_batch_size,
        train_sampling_strategy="group_by_length" if group_by_length else "random",
        remove_unused_columns=False,
        dataloader_num_workers=data.num_workers,
    )


def eval_keys(ev: EvalConfig) -> dict:
    """The evaluation's keys (only with an eval set): when (before the first step, every eval.every_steps), batch items
    (whole micro-batches), what is best."""
    keys = {"eval_strategy": "steps" if ev.every_steps else "no", "per_device_eval_batch_size": 1}
    keys["eval_on_start"] = True  # a fresh run's; a resumed run skips it (RecipeTrainer._evaluate)
    if ev.every_steps:
        keys["eval_steps"] = ev.every_steps
    if ev.best_checkpoint or ev.early_stopping_patience:
        keys.update(metric_for_best_model=ev.metric, greater_is_better=ev.metric.endswith("accuracy"))
    if ev.early_stopping_patience:
        keys["restore_callback_states_from_checkpoint"] = True  # the patience counter resumes
    return keys


def training_arguments(
    train: TrainConfig,
    optim: OptimConfig,
    log: LogConfig,
    data: DataConfig,
    ev: EvalConfig,
    plan: RunPlan,
    batches,
    evaluating: bool,
) -> TrainingArguments:
    """Built before the model: under ZeRO-3 they register DeepSpeed's config (zero3_init_flag), so the model is built
    partitioned (deepspeed.zero.Init) instead of whole in every rank's host memory."""
    return TrainingArguments(
        **train_keys(train, plan.accumulation),
        **log_keys(log, plan.run_name),
        **data_keys(data, batches.per_device_batch_size, batches.group_by_length),
        **(eval_keys(ev) if evaluating else {}),
        learning_rate=plan.peak_lr,
        weight_decay=optim.weight_decay,
        ddp_find_unused_parameters=False,
        accelerator_config=distributed.accelerator_config(train),
        use_cpu=not reporting.has_accelerator(),
    )
