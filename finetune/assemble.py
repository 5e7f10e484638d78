"""`build(cfg, …)`: the trainer a recipe trains with, ready for `.train()`; nothing is written yet.

Top to bottom: launch settings vs the recipe → tokenizer → data → batching → schedule → model → trainer. Everything
the trainer needs comes in as arguments (its class, extra callbacks, the stop request, the device's peak FLOP/s), so
nothing is set on it afterwards. `train.micro_batch_size: auto` is resolved before `build` is called (by the planner,
finetune/tools/plan.py, whose memory trials build trainers here themselves). The commands in finetune/tools/, the
scripts and the tests use it; it imports the wings (recipe, data, model, training), never a command or an entry script.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import TrainerCallback, TrainingArguments, set_seed

from finetune.data import batching, heldout
from finetune.data.chat_templates import use_chat_template
from finetune.data.prompts import sample_prompts
from finetune.data.vision import VisionCollator
from finetune.env import world_size
from finetune.model import loading, vlm
from finetune.model.freeze import check_lora
from finetune.model.packed_attention import use_for_packed_rows
from finetune.recipe import Config, RecipeError, accumulation_steps
from finetune.recipe.checks import precision_on_device, precision_warning
from finetune.training import distributed, evaluation, reporting, schedules
from finetune.training.recipe_trainer import RecipeTrainer


def build(
    cfg: Config,
    *,
    trainer_cls: type[RecipeTrainer] = RecipeTrainer,
    callbacks: Iterable[TrainerCallback] = (),
    stop_request=None,
    peak_flops: float | None = None,
    evaluate: bool = True,
) -> RecipeTrainer:
    """The trainer this recipe trains with: `trainer_cls` (RecipeTrainer or a subclass) given the recipe's model,
    data, arguments and callbacks plus `callbacks`, `stop_request` (finetune.training.lifecycle.StopRequest) and
    `peak_flops` for MFU (default: the recipe's log.peak_tflops, else the trainer's table of GPUs). `evaluate=False`:
    no evaluation (the held-out rows stay out of training all the same)."""
    distributed.check_launch(cfg)  # accelerate launch's settings vs the recipe
    gpu = torch.cuda.get_device_name() if reporting.has_accelerator() else None
    problem = precision_on_device(cfg, gpu, gpu is not None and torch.cuda.is_bf16_supported(including_emulation=False))
    if problem:
        raise RecipeError(problem)
    if precision_warning(cfg):
        reporting.main_print(f"warning: {precision_warning(cfg)}")
    ranks = world_size()
    accumulation = accumulation_steps(cfg, ranks)
    reporting.configure_wandb(cfg)

    # tokenizer (a GGUF is converted once into a plain folder in the cache)
    folder = loading.model_folder(cfg.model)
    vision = vlm.is_vlm(cfg, folder)  # image+text: a processor for a tokenizer, a VLM, image rows
    check_lora(cfg.model, folder, vision)  # model.lora.merge / target_modules against the model, before loading it
    tokenizer = vlm.load_processor(cfg.model, folder) if vision else loading.load_tokenizer(cfg.model, folder)
    use_chat_template(cfg.data, tokenizer)  # data.chat_template, checked before any row is read

    # data, the eval set (finetune/data/heldout.py) and batching, before the model: a bad row fails in seconds
    dataset, report, held_out = heldout.load_datasets(cfg, tokenizer, vision)
    reporting.main_print(f"data: {report.summary()}")
    held_out = held_out if evaluate else None
    if held_out is not None:
        reporting.main_print(held_out.summary)
        prompts = sample_prompts(
            held_out.records, held_out.format, cfg.eval.samples, cfg.eval.prompts, tokenizer, vision
        )
    batches = batching.prepare(cfg, dataset, tokenizer.tokenizer if vision else tokenizer)
    if vision:  # the image processor's tensors join each text batch
        batches.collator = VisionCollator(batches.collator, tokenizer)
    total_steps = batching.count_optimizer_steps(cfg, batches, ranks, accumulation)

    # learning rate and schedule, from the effective batch
    lr = schedules.peak_lr(cfg)
    schedules.check_schedule(total_steps, cfg.schedule)
    reporting.main_print(schedules.startup_line(cfg, ranks, accumulation, total_steps))

    # trainer arguments before the model: under ZeRO-3 they register DeepSpeed's config (zero3_init_flag), so the
    # model is built partitioned (deepspeed.zero.Init) instead of whole in every rank's host memory
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
        # RecipeTrainer judges every window's loss without a host sync (train.on_nonfinite); Trainer's filter would
        # read the loss back after every backward, draining the GPU's queue once per micro-batch
        logging_nan_inf_filter=False,
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
        **(evaluation.training_arguments(cfg) if held_out is not None else {}),
    )

    # model (the packed-row probe cannot run a ZeRO-3 partitioned model: it then keeps sdpa, saying why)
    set_seed(cfg.train.seed)  # the same initial weights (from_config) on every rank and in every run
    model = vlm.load_vlm(cfg.model, folder, tokenizer) if vision else loading.load_model(cfg.model, folder)
    packed = cfg.data.batching == "packed" or (held_out is not None and cfg.eval.batching == "packed")
    if packed and not vision:  # sdpa → causal sdpa per sequence where it gives the same logits
        reporting.main_print(use_for_packed_rows(model))

    # trainer
    if peak_flops is None and cfg.log.peak_tflops:
        peak_flops = cfg.log.peak_tflops * 1e12
    return trainer_cls(
        model=model,
        args=args,
        train_dataset=batches.dataset,
        data_collator=batches.collator,
        processing_class=tokenizer,
        callbacks=[
            reporting.StepCountCheck(total_steps),
            *distributed.callbacks(),
            *reporting.callbacks(cfg),
            *callbacks,
            *(evaluation.callbacks(cfg, prompts) if held_out is not None else ()),
        ],
        optim_config=cfg.optim,
        schedule_config=cfg.schedule,
        peak_lr=lr,
        on_nonfinite=cfg.train.on_nonfinite,
        stop_request=stop_request,
        data_order_change=cfg.train.resume_data_order_change,
        peak_flops=peak_flops,
        **(
            {}
            if held_out is None
            else {
                "eval_dataset": held_out.dataset,
                "eval_setup": evaluation.EvalSetup(held_out.collator, held_out.tokens, cfg.eval.best_checkpoint),
            }
        ),
    )
