"""`build(cfg, …)`: the trainer a recipe trains with, ready for `.train()`; nothing is written yet.

Top to bottom: launch settings and precision vs this machine → tokenizer → data and the eval set → batching → lr
and schedule → arguments → model → trainer. Each step is given the recipe sections it reads, and everything the
trainer needs comes in as constructor arguments (its class, extra callbacks, the stop request, the device's peak
FLOP/s), so nothing is set on it afterwards. `train.micro_batch_size: auto` is resolved into a new config before
`build` is called (finetune/tools/plan.py, whose memory trials build trainers here themselves). The commands in
finetune/tools/, the scripts and the tests use it; it imports the wings (recipe, data, model, training), never a command
or an entry script.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import TrainerCallback, set_seed

from finetune.data import batching, heldout, mixture
from finetune.data.chat_templates import use_chat_template
from finetune.data.prompts import sample_prompts
from finetune.data.vision import VisionCollator
from finetune.env import world_size
from finetune.model import loading, vlm
from finetune.model.freeze import check_lora
from finetune.model.packed_attention import use_for_packed_rows
from finetune.recipe import Config, RecipeError, accumulation_steps, eval_batching, evaluates, training_batching
from finetune.recipe.checks import precision_on_device, precision_warning
from finetune.recipe.set_checks import eval_set_names, ignored_eval_keys
from finetune.training import distributed, evaluation, reporting, schedules
from finetune.training.arguments import training_arguments
from finetune.training.recipe_trainer import RecipeTrainer


def build(
    cfg: Config,
    *,
    trainer_cls: type[RecipeTrainer] = RecipeTrainer,
    callbacks: Iterable[TrainerCallback] = (),
    run_files: Iterable = (),
    stop_request=None,
    peak_flops: float | None = None,
    evaluate: bool = True,
) -> RecipeTrainer:
    """The trainer this recipe trains with: `trainer_cls` (RecipeTrainer or a subclass) given the recipe's model,
    data, arguments and callbacks plus `callbacks`, `run_files` (each one's files_for_checkpoint() goes into every
    checkpoint and the final save: recipe.yaml), `stop_request` (finetune.training.lifecycle.StopRequest) and
    `peak_flops` for MFU (default: the recipe's log.peak_tflops, else the trainer's table of GPUs). `evaluate=False`:
    no evaluation (the held-out rows stay out of training all the same)."""
    check_machine(cfg)
    ranks = world_size()
    accumulation = accumulation_steps(cfg, ranks)
    reporting.configure_wandb(cfg)

    folder, vision, tokenizer = load_tokenizer(cfg)
    inputs = vlm.forward_image_inputs(cfg.model, folder) if vision else None

    # data, the eval set and batching, before the model: a bad row fails in seconds
    batches, eval_sets, prompts = load_data(cfg, tokenizer, vision, evaluate, inputs)
    total_steps = batching.count_optimizer_steps(cfg.train, batches, ranks, accumulation)

    # learning rate and schedule, from the effective batch
    lr = schedules.peak_lr(cfg)
    reporting.main_print(schedules.startup_line(cfg, ranks, accumulation, total_steps))
    if note := schedules.check_schedule(total_steps, cfg.schedule):  # a warmup as long as the run is shortened
        reporting.main_print(note)

    args = training_arguments(cfg, accumulation, lr, batches, evaluating=bool(eval_sets))  # before the model
    model = load_model(cfg, folder, tokenizer, vision, evaluating=bool(eval_sets))
    reports = reporting.reports(cfg)
    return trainer_cls(
        model=model,
        args=args,
        train_dataset=batches.dataset,
        data_collator=batches.collator,
        processing_class=tokenizer,
        callbacks=[
            reporting.StepCountCheck(total_steps),
            *distributed.callbacks(),
            *reports.callbacks,
            *callbacks,
        ],
        optim_config=cfg.optim,
        schedule_config=cfg.schedule,
        peak_lr=lr,
        on_nonfinite=cfg.train.on_nonfinite,
        stop_request=stop_request,
        data_order_change=cfg.train.resume_data_order_change,
        merge_lora=cfg.model.lora.merge,
        run_files=(reports.timings, *run_files),
        reports=reports,
        peak_flops=peak_flops if peak_flops is not None else recipe_peak_flops(cfg),
        **(eval_parts(cfg, eval_sets, prompts) if eval_sets else {}),
    )


def check_machine(cfg: Config) -> None:
    """accelerate launch's settings and this device's precision vs the recipe (a warning for bf16 weights)."""
    distributed.check_launch(cfg)
    gpu = torch.cuda.get_device_name() if reporting.has_accelerator() else None
    problem = precision_on_device(cfg, gpu, gpu is not None and torch.cuda.is_bf16_supported(including_emulation=False))
    if problem:
        raise RecipeError(problem)
    if warning := precision_warning(cfg):
        reporting.main_print(f"warning: {warning}")


def load_tokenizer(cfg: Config):
    """(the model's folder, whether it takes images, its tokenizer or processor): a GGUF is converted once into a
    plain folder in the cache; LoRA keys and data.chat_template are checked against the model, before its weights."""
    folder = loading.model_folder(cfg.model)
    vision = vlm.is_vlm(cfg, folder)
    check_lora(cfg.model, folder, vision)  # model.lora.merge / target_modules against the model, before loading it
    tokenizer = vlm.load_processor(cfg.model, folder) if vision else loading.load_tokenizer(cfg.model, folder)
    use_chat_template(cfg.data, tokenizer)  # data.chat_template, checked before any row is read
    return folder, vision, tokenizer


def load_data(cfg: Config, tokenizer, vision: bool, evaluate: bool, inputs=None):
    """(the training micro-batches, {name: eval set}, the sample prompts); no eval set ({}) without one or with
    `evaluate=False`. One unnamed eval set is named "". Image rows get `inputs` (finetune/data/image_inputs.py)."""
    data, seed = cfg.data, cfg.train.seed
    load_rows = mixture.load_mixture if data.mixture else heldout.load_training_set
    dataset, report, held = load_rows(data, cfg.eval.fraction, seed, tokenizer, vision)
    reporting.main_print(f"data: {report.summary()}")
    eval_sets, prompts = {}, []
    if ignored := ignored_eval_keys(cfg):  # eval.fraction=0 alone turns evaluation off
        reporting.main_print(f"note: no eval set (eval.fraction=0, no eval.source): {', '.join(ignored)} ignored")
    if evaluate and evaluates(cfg):
        training = None if data.streaming else dataset
        eval_sets = heldout.load_eval_sets(
            cfg.eval, data, held, eval_set_names(cfg), training, seed, tokenizer, vision, inputs
        )
        for eval_set in eval_sets.values():
            reporting.main_print(eval_set.summary)
        prompts = eval_prompts(cfg, next(iter(eval_sets.values())), tokenizer, vision)
    batches = batching.prepare(training_batching(cfg), dataset, tokenizer.tokenizer if vision else tokenizer, seed)
    if vision:  # the image processor's tensors join each text batch
        batches.collator = VisionCollator(batches.collator, tokenizer, inputs)
    return batches, eval_sets, prompts


def load_model(cfg: Config, folder: str, tokenizer, vision: bool, evaluating: bool):
    """The model, the same initial weights on every rank and in every run (from_config is seeded); packed rows get
    per-sequence attention (the packed-row probe cannot run a ZeRO-3 partitioned model: it then keeps sdpa, saying
    why)."""
    set_seed(cfg.train.seed)
    model = vlm.load_vlm(cfg.model, folder, tokenizer) if vision else loading.load_model(cfg.model, folder)
    reporting.main_print(reporting.parameters_line(model))  # after model.freeze and LoRA: what trains
    packs = training_batching(cfg).packs or (evaluating and eval_batching(cfg.eval).packs)
    if packs:  # sdpa → causal sdpa per sequence (a VLM: in its language model) where it gives the same logits
        reporting.main_print(use_for_packed_rows(model))
    return model


def eval_prompts(cfg: Config, eval_set: heldout.EvalSet, tokenizer, vision: bool) -> list:
    """The held-out prompts samples are generated from at each evaluation (eval.samples, eval.prompts)."""
    ev = cfg.eval
    return sample_prompts(eval_set.records, eval_set.format, ev.samples, ev.prompts, tokenizer, vision)


def eval_parts(cfg: Config, eval_sets: dict, prompts: list) -> dict:
    """The trainer's eval arguments: one dataset, or {name: dataset} for named sets (evaluated in one pass, one
    log line: finetune/training/recipe_trainer.py), and the evaluation's callbacks (samples from `prompts`)."""
    first = next(iter(eval_sets.values()))
    tokens = sum(s.tokens for s in eval_sets.values())
    setup = evaluation.EvalSetup(first.collator, tokens, cfg.eval.best_checkpoint)
    datasets = first.dataset if list(eval_sets) == [""] else {name: s.dataset for name, s in eval_sets.items()}
    callbacks = evaluation.callbacks(cfg, prompts)
    return {"eval_dataset": datasets, "eval_setup": setup, "eval_callbacks": callbacks}


def recipe_peak_flops(cfg: Config) -> float | None:
    """log.peak_tflops in FLOP/s (None: the trainer's table of GPUs)."""
    return cfg.log.peak_tflops * 1e12 if cfg.log.peak_tflops else None
