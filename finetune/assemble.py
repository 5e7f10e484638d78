"""`build(cfg, …)`: the trainer a recipe trains with, ready for `.train()`; nothing is written yet.

Top to bottom: the run plan (every fact the recipe implies for this launch, resolved once: finetune/recipe/run_plan.py)
→ launch settings and precision vs this machine → tokenizer and the kind of rows → data and the eval sets → steps,
lr and schedule → arguments → model → trainer. Each step is given the recipe sections it reads and the plan, and
everything the trainer needs comes in as constructor arguments (its class, extra callbacks, the stop request, the
device's peak FLOP/s), so nothing is set on it afterwards. `train.micro_batch_size: auto` is resolved into a new
config and plan before `build` is called (finetune/tools/plan.py, whose memory trials build trainers here
themselves). The commands in
finetune/tools/, the scripts and the tests use it; it imports the wings (recipe, data, model, training), never a command
or an entry script.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback, set_seed
from transformers.trainer_utils import unwrap_peft_model

from finetune.core.heads import unplaced_loss_keys
from finetune.core.router_balance import config_router_loss, has_router_loss
from finetune.data import batching, mixture, training_set
from finetune.data.chat_templates import use_chat_template
from finetune.data.image_inputs import ImageInputs
from finetune.data.row_kinds import TEXT_ROWS, RowKind, image_text_rows
from finetune.env import world_size
from finetune.evaluation import metrics, sets
from finetune.evaluation.prompts import sample_prompts
from finetune.model import describe, layer_kernels, loading, quantized, vlm
from finetune.model.freeze import check_lora
from finetune.model.packed_attention import use_for_packed_rows
from finetune.model.sequence_mixers import check_packed_mixers
from finetune.recipe import (
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RecipeError,
    RunPlan,
    ScheduleConfig,
    TrainConfig,
    resolve_plan,
    to_tree,
)
from finetune.recipe.checks import levers_on_device, precision_on_device, precision_warning
from finetune.training import distributed, reporting, schedules
from finetune.training.arguments import training_arguments
from finetune.training.optim import optimizer_line
from finetune.training.recipe_trainer import RecipeTrainer


def build(
    cfg: Config,
    plan: RunPlan | None = None,
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
    `peak_flops` for MFU (default: the recipe's log.peak_tflops, else the trainer's table of GPUs). `plan`: the
    recipe's run plan (default: resolved for this launch's ranks). `evaluate=False`: no evaluation (the held-out
    rows stay out of training all the same). The one place that opens the recipe: each step below is given the
    sections it reads."""
    plan = plan if plan is not None else resolve_plan(cfg, world_size())
    check_machine(cfg.train, cfg.optim, cfg.model, cfg.data, plan)
    reporting.configure_wandb(cfg.log, cfg.train)
    folder, rows, tokenizer = load_tokenizer(cfg.model, cfg.data, cfg.train, plan)
    data = load_data(cfg.data, cfg.eval, cfg.train.seed, plan, tokenizer, rows, evaluate)  # a bad row fails in seconds
    total_steps = optimizer_steps(cfg.train, cfg.data, cfg.optim, cfg.schedule, plan, data.batches)
    args = training_arguments(  # before the model
        cfg.train, cfg.optim, cfg.log, cfg.data, cfg.eval, plan, data.batches, evaluating=bool(data.eval_sets)
    )
    packs = plan.packs if data.eval_sets else plan.training.packs
    model = load_model(cfg.model, cfg.train, folder, tokenizer, rows, plan.instead_of_packing if packs else None)
    reporting.main_print(optimizer_start_line(cfg.train, cfg.optim))
    reports = reporting.reports(cfg.train, cfg.log, to_tree(cfg))
    return trainer_cls(
        model=model,
        args=args,
        train_dataset=data.batches.dataset,
        data_collator=data.batches.collator,
        processing_class=tokenizer,
        callbacks=[*run_callbacks(total_steps, reports), *callbacks],
        run_files=(reports.timings, *run_files),
        reports=reports,
        stop_request=stop_request,
        peak_flops=peak_flops if peak_flops is not None else recipe_peak_flops(cfg.log),
        **recipe_options(cfg.train, cfg.optim, cfg.schedule, cfg.model, plan),
        **data.eval_parts(cfg.eval),
    )


def recipe_options(
    train: TrainConfig, optim: OptimConfig, schedule: ScheduleConfig, model: ModelConfig, plan: RunPlan
) -> dict:
    """What the recipe asks of the trainer beyond TrainingArguments: its optimizer and schedule (at the plan's peak
    lr), what a non-finite step does, a resume's data order, a merged LoRA save."""
    return dict(
        optim_config=optim,
        schedule_config=schedule,
        peak_lr=plan.peak_lr,
        on_nonfinite=train.on_nonfinite,
        data_order_change=train.resume_data_order_change,
        merge_lora=model.lora.merge,
        activation_offloading=train.activation_offloading,
        moe_balance="micro" if train.moe_balance == "auto" else train.moe_balance,
    )


def optimizer_steps(
    train: TrainConfig,
    data: DataConfig,
    optim: OptimConfig,
    schedule: ScheduleConfig,
    plan: RunPlan,
    batches: batching.Batches,
) -> int:
    """The run's optimizer steps, said with the batch and lr on the start-up line (and a warmup shortened to fit)."""
    total_steps = batching.count_optimizer_steps(train, batches, plan.ranks, plan.accumulation)
    reporting.main_print(schedules.startup_line(train, data, optim, plan, total_steps))
    if note := schedules.check_schedule(total_steps, schedule):  # a warmup as long as the run is shortened
        reporting.main_print(note)
    return total_steps


def run_callbacks(total_steps: int, reports: reporting.RunReports) -> list[TrainerCallback]:
    """The step-count guard, the launcher's own callbacks and the recipe's reporting (console, W&B, timings)."""
    return [reporting.StepCountCheck(total_steps), *distributed.callbacks(), *reports.callbacks]


def check_machine(train: TrainConfig, optim: OptimConfig, model: ModelConfig, data: DataConfig, plan: RunPlan) -> None:
    """accelerate launch's settings, this device's precision and the speed levers vs the recipe (a warning for bf16
    weights)."""
    distributed.check_launch(train, optim, data, plan)
    gpu = torch.cuda.get_device_name() if reporting.has_accelerator() else None
    bf16 = gpu is not None and torch.cuda.is_bf16_supported(including_emulation=False)
    for problem in (precision_on_device(train, model, gpu, bf16), levers_on_device(model, gpu)):
        if problem:
            raise RecipeError(problem)
    if warning := precision_warning(model):
        reporting.main_print(f"warning: {warning}")


def check_moe_balance(train: TrainConfig, model_name: str, router_loss: bool) -> None:
    """train.moe_balance set (micro or window) for a model that adds no router balancing loss: one line."""
    if train.moe_balance != "auto" and not router_loss:
        raise RecipeError(
            f"train.moe_balance={train.moe_balance}: {model_name} adds no router balancing loss (not a mixture of "
            "experts, or its config's output_router_logits is off); remove the key (auto balances where there is "
            "a loss to balance)"
        )


def check_config(model: ModelConfig, train: TrainConfig, plan: RunPlan, config) -> None:
    """What the model's config tells before its weights load: a loss term its forward adds that the exact token mean
    cannot place, train.moe_balance without a router loss, packed rows its layers would mix."""
    if terms := unplaced_loss_keys(config):
        raise RecipeError(
            f"model.name_or_path={model.name_or_path}: its config's {', '.join(terms)} adds a loss term to its "
            "forward's loss that this trainer does not compute (the exact token mean would drop it); set it to 0 in "
            "the model folder's config.json (or model.config_overrides with model.from_config=true) to train without it"
        )
    check_moe_balance(train, f"model.name_or_path={model.name_or_path}", config_router_loss(config))
    if plan.packs:
        check_packed_mixers(model, plan, config)


def load_tokenizer(model: ModelConfig, data: DataConfig, train: TrainConfig, plan: RunPlan):
    """(the model's folder, the kind of rows it reads, its tokenizer or processor): a GGUF is converted once into a
    plain folder in the cache; packed rows, train.moe_balance, LoRA keys and data.chat_template are checked against
    the model, before its weights."""
    folder = loading.model_folder(model)
    vision = vlm.is_vlm(model, data, plan, folder)
    if (config := loading.model_config(model, folder)) is not None:  # before any weight loads
        check_config(model, train, plan, config)
    rows = image_text_rows(ImageInputs(**vlm.forward_image_inputs(model, folder))) if vision else TEXT_ROWS
    check_lora(model, folder, vision)  # model.lora.merge / target_modules against the model, before loading it
    tokenizer = vlm.load_processor(model, folder) if vision else loading.load_tokenizer(model, folder)
    use_chat_template(data, tokenizer)  # data.chat_template, checked before any row is read
    return folder, rows, tokenizer


@dataclass
class RunData:
    """The training micro-batches, the eval sets ({} without evaluation; one unnamed set is named "") and the
    prompts samples are generated from at each evaluation."""

    batches: batching.Batches
    eval_sets: dict = field(default_factory=dict)
    prompts: list = field(default_factory=list)

    def eval_parts(self, ev: EvalConfig) -> dict:
        """The trainer's eval arguments: one dataset, or {name: dataset} for named sets (evaluated in one pass, one
        log line: finetune/training/recipe_trainer.py), and the evaluation's callbacks (samples from the prompts);
        none without evaluation."""
        if not self.eval_sets:
            return {}
        sets = self.eval_sets
        first = next(iter(sets.values()))
        setup = metrics.EvalSetup(first.collator, sum(s.tokens for s in sets.values()), ev.best_checkpoint)
        datasets = first.dataset if list(sets) == [""] else {name: s.dataset for name, s in sets.items()}
        callbacks = metrics.callbacks(ev, self.prompts)
        return {"eval_dataset": datasets, "eval_setup": setup, "eval_callbacks": callbacks}


def load_data(
    data: DataConfig, ev: EvalConfig, seed: int, plan: RunPlan, tokenizer, rows: RowKind, evaluate: bool
) -> RunData:
    """The training micro-batches and, where the recipe evaluates and `evaluate`, its eval sets and sample prompts
    (`seed`: train.seed)."""
    load_rows = mixture.load_mixture if data.mixture else training_set.load_training_set
    dataset, report, held = load_rows(data, ev.fraction, seed, tokenizer, rows)
    reporting.main_print(f"data: {report.summary()}")
    for line in report.notes():  # what the chat template drops of the rows, said once
        reporting.main_print(f"note: {line}")
    if plan.ignored_eval_keys:  # eval.fraction=0 alone turns evaluation off
        ignored = ", ".join(plan.ignored_eval_keys)
        reporting.main_print(f"note: no eval set (eval.fraction=0, no eval.source): {ignored} ignored")
    batches = batching.prepare(plan.training, dataset, rows.text_tokenizer(tokenizer), seed)
    run_data = RunData(batches=dataclasses.replace(batches, collator=rows.collator(batches.collator, tokenizer)))
    if evaluate and plan.evaluation is not None:
        training = None if data.streaming else dataset
        run_data.eval_sets = sets.load_eval_sets(
            ev, plan.evaluation, data, held, plan.eval_sets, training, seed, tokenizer, rows
        )
        for eval_set in run_data.eval_sets.values():
            reporting.main_print(eval_set.summary)
        first = next(iter(run_data.eval_sets.values()))  # samples are generated from its held-out prompts
        run_data.prompts = sample_prompts(first.records, first.format, ev.samples, ev.prompts, tokenizer, rows.images)
    return run_data


def load_model(model_cfg: ModelConfig, train: TrainConfig, folder: str, tokenizer, rows: RowKind, packing: str | None):
    """The model, the same initial weights on every rank and in every run (from_config is seeded with train.seed);
    packed rows (`packing`: the way out of them, RunPlan.instead_of_packing; None: no rows pack) get per-sequence
    attention (the packed-row probe cannot run a ZeRO-3 partitioned model: it then keeps sdpa, saying why); then the
    speed levers the recipe turns on (finetune/model/layer_kernels.py)."""
    if model_cfg.liger_kernels and rows.images:
        raise RecipeError("model.liger_kernels=true applies to text models; set it false for a vision-language model")
    set_seed(train.seed)
    model = vlm.load_vlm(model_cfg, folder, tokenizer) if rows.images else loading.load_model(model_cfg, folder)
    reporting.main_print(reporting.parameters_line(model))  # after model.freeze and LoRA: what trains
    reporting.main_print(describe.weights_line(model))
    if line := describe.adapter_line(model):
        reporting.main_print(line)
    if line := quantized.unquantized_experts_line(model, model_cfg):
        reporting.main_print(line)
    if model_cfg.liger_kernels:  # on the transformers model under a LoRA wrapper: its norm and MLP modules stay
        reporting.main_print(layer_kernels.use_liger_kernels(layer_kernels.base_model(model)))
    check_moe_balance(train, type(unwrap_peft_model(model)).__name__, has_router_loss(unwrap_peft_model(model)))
    if line := loading.attention_line(model_cfg, unwrap_peft_model(model)):
        reporting.main_print(line)
    if (
        packing is not None
    ):  # sdpa → causal sdpa per sequence (a VLM: in its language model) where it gives the same logits
        reporting.main_print(use_for_packed_rows(model, packing))
    if train.compile_layers:  # last: the layers are compiled as they will run
        reporting.main_print(layer_kernels.compile_layers(model))
    return model


def optimizer_start_line(train: TrainConfig, optim: OptimConfig) -> str:
    """The optimizer as it will step on this machine: on a GPU fused, unless a GradScaler unscales its gradients
    (train.precision=fp16 outside DeepSpeed, whose own loss scaler is not accelerate's)."""
    gpu = reporting.has_accelerator()
    return optimizer_line(optim, gpu, gpu and train.precision == "fp16" and not distributed.uses_deepspeed())


def recipe_peak_flops(log: LogConfig) -> float | None:
    """log.peak_tflops in FLOP/s (None: the trainer's table of GPUs)."""
    return log.peak_tflops * 1e12 if log.peak_tflops else None
