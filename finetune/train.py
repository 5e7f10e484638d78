"""Fine-tune a model from a recipe.

    accelerate launch finetune/train.py recipe=recipes/quickstart.yaml optim.lr=1e-5
    python finetune/train.py recipe=recipes/debug.yaml train.max_steps=3

Top to bottom: recipe → tokenizer → data → batching → schedule → model → trainer → train → save. `build(cfg)` stops
before training, so `finetune.verify` and `finetune.plan` run exactly what training runs.
"""

from __future__ import annotations

import sys

from finetune import env
from finetune.recipe import Config, RecipeError, accumulation_steps, load_config, to_yaml


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv)
        return train(cfg, argv=argv)
    except RecipeError as e:
        if env.is_main_process():
            print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 3: training stopped on a non-finite value (train.on_nonfinite=stop)


def build(cfg: Config, callbacks: tuple = ()):
    """The trainer this recipe trains with, ready for `.train()`; nothing is written yet."""
    if cfg.train.micro_batch_size == "auto":  # the largest that fits, global batch kept; recipe.yaml records it
        from finetune.plan import resolve_auto_micro_batch

        resolve_auto_micro_batch(cfg)
    from finetune.training import distributed

    distributed.check_launch(cfg)  # accelerate launch's settings vs the recipe, before anything heavy
    # Heavy imports after the recipe is known good: a typo fails in a second, not after loading torch.
    from transformers import PrinterCallback, TrainingArguments, set_seed

    from finetune.training import reporting, schedules
    from finetune.model import loading as models
    from finetune.model import vlm
    from finetune.data import batching
    from finetune.data.text import load_sft_dataset
    from finetune.data.streaming import stream_sft_dataset
    from finetune.recipe_trainer import RecipeTrainer
    from finetune.data.vision import VisionCollator, load_vision_dataset

    if cfg.train.precision == "fp16" and not reporting.has_accelerator():
        # Accelerate runs fp16 on a CPU as plain fp32 (no autocast, no GradScaler): say so instead
        raise RecipeError("train.precision=fp16 needs a GPU; on a CPU use train.precision=bf16 or fp32")
    ranks = env.world_size()
    accumulation = accumulation_steps(cfg, ranks)
    reporting.configure_wandb(cfg)

    # tokenizer (a GGUF is converted once into a plain folder in the cache)
    folder = models.model_folder(cfg.model)
    vision = vlm.is_vlm(cfg, folder)  # image+text: a processor for a tokenizer, a VLM, image rows (finetune/model/vlm.py)
    tokenizer = vlm.load_processor(cfg.model, folder) if vision else models.load_tokenizer(cfg.model, folder)

    # data and batching, before the model: a bad row fails in seconds
    if cfg.data.streaming:
        dataset, report = stream_sft_dataset(cfg.data, tokenizer, cfg.train.seed)
    else:
        dataset, report = (load_vision_dataset if vision else load_sft_dataset)(cfg.data, tokenizer)
    reporting.main_print(f"data: {report.summary()}")
    batches = batching.prepare(cfg, dataset, tokenizer.tokenizer if vision else tokenizer)
    if vision:  # the image processor's tensors join each text batch
        batches.collator = VisionCollator(batches.collator, tokenizer)
    total_steps = batching.count_optimizer_steps(cfg, batches, ranks, accumulation)

    # learning rate and schedule, from the effective batch
    lr = schedules.peak_lr(cfg)
    schedules.check_schedule(total_steps, cfg.schedule)
    reporting.main_print(schedules.startup_line(cfg, ranks, accumulation, total_steps))

    # model
    set_seed(cfg.train.seed)  # the same initial weights (from_config) on every rank and in every run
    model = vlm.load_vlm(cfg.model, folder, tokenizer) if vision else models.load_model(cfg.model, folder)
    if cfg.data.batching == "packed" and not vision:  # sdpa → causal sdpa per sequence (finetune/model/packed_attention.py)
        from finetune.model.packed_attention import use_for_packed_rows

        reporting.main_print(use_for_packed_rows(model))

    # trainer
    args = TrainingArguments(
        output_dir=cfg.train.output_dir,
        per_device_train_batch_size=batches.per_device_batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=cfg.train.max_steps,
        num_train_epochs=cfg.train.epochs,
        learning_rate=lr,
        weight_decay=cfg.optim.weight_decay,
        max_grad_norm=cfg.train.max_grad_norm,
        bf16=cfg.train.precision == "bf16",
        fp16=cfg.train.precision == "fp16",
        seed=cfg.train.seed,
        logging_steps=cfg.log.every_steps,
        report_to=[],  # W&B through reporting.RecipeWandbCallback (the recipe as run config)
        disable_tqdm=True,  # reporting.StepProgress draws the bar and one line per step
        run_name=reporting.run_name(cfg),
        save_strategy="steps" if cfg.train.save_steps > 0 else "no",
        save_steps=max(cfg.train.save_steps, 1),
        save_total_limit=cfg.train.save_total_limit,
        activation_checkpointing=cfg.train.gradient_checkpointing,
        train_sampling_strategy="group_by_length" if batches.group_by_length else "random",
        remove_unused_columns=False,
        dataloader_num_workers=cfg.data.num_workers,
        ddp_find_unused_parameters=False,
        accelerator_config=distributed.accelerator_config(cfg),
        use_cpu=not reporting.has_accelerator(),
    )
    trainer = RecipeTrainer(
        model=model,
        args=args,
        train_dataset=batches.dataset,
        data_collator=batches.collator,
        processing_class=tokenizer,
        callbacks=[reporting.StepCountCheck(total_steps), *distributed.callbacks(), *reporting.callbacks(cfg), *callbacks],
        optim_config=cfg.optim,
        schedule_config=cfg.schedule,
        peak_lr=lr,
        on_nonfinite=cfg.train.on_nonfinite,
    )
    trainer.remove_callback(PrinterCallback)  # the dict-per-step printer of disable_tqdm; StepProgress prints instead
    if cfg.log.peak_tflops:
        trainer.peak_flops = cfg.log.peak_tflops * 1e12
    return trainer


def train(cfg: Config, callbacks: tuple = (), argv: list[str] | None = None) -> int:
    from finetune.training import checkpoints, lifecycle, reporting

    lifecycle.check_writable(cfg.train.output_dir)  # now, not at the first save hours later
    stop = lifecycle.StopRequest()  # SIGTERM/SIGINT: finish the optimizer step, save a checkpoint, exit 0
    with stop.installed():
        trainer = build(cfg, callbacks)
        trainer.stop_request = stop
        lifecycle.check_space(cfg.train.output_dir, trainer.model)
        resume = checkpoints.resume_path(cfg.train)  # auto: the newest complete checkpoint-N, or a fresh start
        if line := lifecycle.start_line(cfg.train, resume):
            reporting.main_print(line)
        trainer.train(resume_from_checkpoint=resume)
        if stop.requested and trainer.state.global_step < trainer.state.max_steps:
            reporting.main_print(lifecycle.stopped_message(stop, trainer, sys.argv[1:] if argv is None else argv))
            lifecycle.leave_together(trainer)
            return 0

        # save: trainer_state.json has one log_history entry per logged optimizer step; each file lands whole
        lifecycle.save_final(trainer, {"recipe.yaml": to_yaml(cfg)} if trainer.is_world_process_zero() else {})
    figures = reporting.summary(cfg, trainer)
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, reporting.RecipeWandbCallback):
            callback.finish(figures)
    if trainer.is_world_process_zero():
        reporting.print_summary(cfg, trainer, figures)
    lifecycle.leave_together(trainer)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    from finetune.env import exit_process

    exit_process(code)
