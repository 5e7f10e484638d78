"""Prove on your own recipe that training applies the exact token-mean gradient.

    python -m finetune.verify recipe=recipes/debug.yaml [key=value …] [verify.steps=2] [verify.tolerance=1e-5]
    accelerate launch -m finetune.verify recipe=recipes/quickstart.yaml

The recipe runs as training runs it (`finetune.assemble.build`: model, data, batching, precision, ranks, LoRA/freeze)
for `verify.steps` optimizer steps (default 1), with the recipe's trainer class recording what it does
(`reference_check.recording_trainer`). Just before each optimizer step the applied gradient is captured and compared
with a reference computed from the rows that window really held (gathered from every rank): each sequence alone,
unpadded, in float64 (float32 when the model does not fit), with the loss written out in finetune/testing/reference.py
(not `finetune.core.loss`; the brute force the tests use too), then clipped by the factor the trainer clipped with
(`train.max_grad_norm`). A row becomes model inputs through the recipe's own collator given that one row (nothing to
pad or pack), so image rows of a VLM recipe come with their pixel values. This module runs the recipe and reports;
reference_check records the windows and places the reference. Exit 0 when both checks pass, 1 when one fails, 2 for
a recipe error:

- relative error ‖applied − reference‖ / ‖reference‖ (also per parameter group), judged against a measured floor: the
  same brute force computed again in the run's own arithmetic (float32 weights, or the recipe's `model.dtype`, under
  the run's bf16/fp16 autocast) is off the float64 reference by some amount, and no run can be asked to be closer
  than that. A step passes within FLOOR_FACTOR × that floor, or within the fixed tolerance of the lowest precision
  among `train.precision` and `model.dtype` where that is larger (TOLERANCES: fp32 1e-5; bf16 5e-2; fp16 1e-2).
  Rounding grows with depth and falls with precision; `verify.tolerance=` replaces both with one number.
- micro-batch weights: the least-squares w with applied ≈ Σ_k w_k × reference_k over the window's micro-batches (all
  ranks). Every w_k is 1 when every target token counts once, up to rounding, within WEIGHT_TOLERANCES; a
  normalization bug moves them far (a mean of micro-batch means: each micro-batch weighted by the window's targets
  over accumulation × its own; DDP scaling: W or 1/W; accumulation divided twice: 1/K).

The figures measured on the shipped recipes are in docs/exactness.md.

Changed for the check, none of which can change the gradient: output in a temporary directory (removed after), no
checkpoints, W&B off, no resume, no evaluation (rows an eval.fraction holds out stay out of training all the same),
`data.num_workers=0` (rows are recorded in this process). And so that the step is deterministic, in the trained model
and the reference alike: every dropout is off (each drop probability of its modules and config, sub-configs
included), and before the first forward the first micro-batch runs through the model twice
(finetune/testing/determinism.py): a module whose output differs between the two for the same input (PhiMoE's router
samples its experts in training mode) runs in evaluation mode for the check, said in one line; one random in
evaluation mode too is refused in one line naming it. A FAIL is then a difference of the trainer from the brute force,
never of two random draws.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import dataclass, field, replace

from finetune.env import is_main_process, world_size
from finetune.recipe import Config, RecipeError, is_budgeted, load_config, split_tool_args
from finetune.recipe.usage import Command, ToolKey, help_asked, print_page
from finetune.tools.boundary import run_command
from finetune.tools.reference_check import (
    WindowRecorder,
    compare,
    micro_batch_weights,
    recording_trainer,
    reference_model,
    reference_placement,
)

TOLERANCES = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
# Ours may be this many times further from float64 than the brute force in the run's own arithmetic: batched GEMMs,
# packed rows and a chunked head sum in other orders than one sequence at a time (the ratios measured on the shipped
# recipes are in docs/exactness.md). A normalization bug is off by 1e-2 or more (tests/test_verify.py's mutations).
FLOOR_FACTOR = 2.0
# Largest |w - 1| of the micro-batch weights (`micro_batch_weights`): rounding barely moves them, normalization bugs do
WEIGHT_TOLERANCES = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
# Two identical forwards of the first micro-batch further apart than this fraction of the tolerance: the forward draws
# at random (rounding of a kernel's order of summation stays far below; dropout moves activations by tens of percent)
RANDOM_FRACTION = 0.1
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
COMMAND = Command(
    "finetune-verify",
    "Check on your recipe that training applies the exact token-mean gradient (float64 reference); exit 1 if not.",
    also=("python -m finetune.verify …", "accelerate launch -m finetune.verify …"),
    tool="verify",
    keys=(
        ToolKey("steps", int, "1", "optimizer steps trained and checked"),
        ToolKey(
            "tolerance",
            float,
            "by precision: " + ", ".join(f"{p} {t:g}" for p, t in TOLERANCES.items()),
            "largest relative error that passes",
        ),
    ),
)


@dataclass
class StepCheck:
    step: int
    rows: int
    label_tokens: int
    error: float  # ‖applied − reference‖ / ‖reference‖ over all trainable parameters
    groups: dict[str, tuple[float, float]] = field(default_factory=dict)  # group → (relative error, ‖reference‖)
    clip: float = 1.0  # the factor clipping applied to the reference (1: not clipped)
    norms: tuple[float, float] | None = None  # pre-clip gradient norm: (the trainer's, the reference's)
    weights: list[float] | None = None  # per micro-batch (all ranks): applied ≈ Σ w_k × reference_k
    reference_loss: float = 0.0
    logged_loss: float | None = None
    floor: float = 0.0  # the same brute force in the run's own arithmetic, against the float64 reference


def split_args(argv: list[str]) -> tuple[list[str], int, float | None]:
    """(recipe arguments, verify.steps, verify.tolerance): the verify.* keys are this tool's, not the recipe's."""
    rest, given = split_tool_args(argv, "verify", {key.name: key.parse for key in COMMAND.keys})
    for name, number in given.items():
        if not 0 < number < math.inf:  # NaN too
            raise RecipeError(f"verify.{name}={number} must be positive")
    return rest, given.get("steps", 1), given.get("tolerance")


def check_verifiable(cfg: Config) -> None:
    """What verify cannot check: an 8-bit base (a 4-bit one is checked over its dequantized weights)."""
    if cfg.model.quantization.bits == "8":
        raise RecipeError(
            "finetune.verify: model.quantization.bits=8 (LLM.int8) rounds each matmul's activations to 8 bits "
            "too, which no float reference replays; verify with model.quantization.bits=4 or none"
        )


def tolerance_for(cfg: Config) -> tuple[float, str]:
    """The tolerance of the lowest precision the step runs in (mixed precision or the weights' own dtype)."""
    precision = max((cfg.train.precision, PRECISION_OF_DTYPE[cfg.model.dtype]), key=TOLERANCES.get)
    return TOLERANCES[precision], precision


def run(cfg: Config, steps: int = 1) -> list[StepCheck]:
    """Train `steps` optimizer steps of the recipe and check each; the checks on rank 0, [] elsewhere."""
    from finetune.assemble import build
    from finetune.testing.reference import silence_dropout
    from finetune.training import recipe_trainer

    recorder = WindowRecorder(threshold=tolerance_for(cfg)[0] * RANDOM_FRACTION)
    trainer_cls = recording_trainer(recipe_trainer.RecipeTrainer, recorder, steps)
    with tempfile.TemporaryDirectory(prefix="finetune-verify-") as output_dir:
        trial = replace(  # nothing saved, resumed, reported or loaded in worker processes
            cfg,
            train=replace(cfg.train, save_steps=0, resume_from=None, output_dir=output_dir),
            log=replace(cfg.log, wandb_mode="disabled"),
            data=replace(cfg.data, num_workers=0),
        )
        trainer = build(trial, trainer_cls=trainer_cls, evaluate=False)  # held-out rows stay out, unevaluated
        silence_dropout(trainer.model)
        trainer.train()
    return check_windows(cfg, recorder, trainer) if is_main_process() else []


def check_windows(cfg: Config, recorder: WindowRecorder, trainer) -> list[StepCheck]:
    """Each recorded window's applied gradient against the float64 brute force, one sequence at a time."""
    import gc

    import psutil
    import torch

    from finetune.model.quantized import dequantize_base
    from finetune.testing.reference import exact_experts, window_gradient

    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e}
    model, max_norm = reference_model(trainer.accelerator, trainer.model), trainer.args.max_grad_norm
    model = dequantize_base(model)  # a 4-bit base: the dequantized weights its forward multiplied by, as plain floats
    exact_experts(model)  # a mixture of experts' grouped matmul has no float64 kernel
    trainer.release_training_state()
    gc.collect()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    n_trainable = sum(p.numel() for p in trainable.values())
    dtype, device = reference_placement(model, n_trainable)
    model.to(device=device, dtype=dtype)
    model.train()
    print(f"verify: reference in {str(dtype).removeprefix('torch.')} on {device}, one sequence at a time", flush=True)

    logits_of, inputs_of = readers(cfg, recorder, model, device)
    checks = []
    for capture_k in recorder.captures:
        with torch.no_grad():
            for name, value in capture_k["params"].items():
                trainable[name].copy_(value)
        micro_batches = capture_k["rows"]
        own = None
        if dtype == torch.float64:
            own = own_arithmetic_gradient(cfg, model, micro_batches, (logits_of, inputs_of), device)
        model.to(dtype)  # the captured float32 values: exact in float64
        keep_parts = len(micro_batches) * n_trainable * 4 <= psutil.virtual_memory().available / 4
        reference, loss, targets, parts = window_gradient(model, micro_batches, logits_of, dtype, keep_parts=keep_parts)
        reference, parts = with_balance(model, micro_batches, (inputs_of, cfg.train.moe_balance), reference, parts)
        clip, norms = 1.0, None
        if capture_k["norm"] is not None:
            norms = (capture_k["norm"], math.sqrt(sum(float((g.double() ** 2).sum()) for g in reference.values())))
            clip = min(1.0, max_norm / (norms[0] + 1e-6))  # what torch.nn.utils.clip_grad_norm_ multiplies by
            reference = {n: g * clip for n, g in reference.items()}
        error, groups = compare(capture_k["grads"], reference)
        floor = compare({n: g * clip for n, g in own.items()}, reference)[0] if own is not None else 0.0
        weights = micro_batch_weights(capture_k["grads"], parts, clip) if parts else None
        step, rows = capture_k["step"], sum(len(micro_batch) for micro_batch in micro_batches)
        checks.append(
            StepCheck(step, rows, targets, error, groups, clip, norms, weights, loss, logged.get(step), floor)
        )
    return checks


def readers(cfg: Config, recorder: WindowRecorder, model, device):
    """(logits of one row alone: the collator on one row pads nothing and packs nothing; a micro-batch's inputs as
    the recipe's collator gives them to the model, images included): no labels, floating inputs in the model's
    dtype."""
    import torch

    def inputs_of(rows: list[dict]) -> dict:
        batch = recorder.collate([rows] if is_budgeted(cfg.data) else rows)
        weights = next(model.parameters()).dtype
        return {
            k: v.to(device, weights) if v.is_floating_point() else v.to(device)
            for k, v in batch.items()
            if k != "labels" and isinstance(v, torch.Tensor)
        }

    def logits_of(model, row: dict):
        return model(**inputs_of([row]))["logits"]

    return logits_of, inputs_of


def own_arithmetic_gradient(cfg: Config, model, micro_batches, reading, device) -> dict:
    """The brute force again in the run's own arithmetic: weights in float32 (or the recipe's model.dtype), logits
    under the run's bf16/fp16 autocast, the loss in float32. Its distance from the float64 reference is the floor.
    `reading`: (logits of one row, a micro-batch's model inputs)."""
    import contextlib

    import torch

    from finetune.testing.reference import window_gradient

    logits_of, inputs_of = reading
    weights = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype, torch.float32)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    model.to(weights)

    def autocast():
        return torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()

    def own_logits(model, row):
        with autocast():
            return logits_of(model, row)

    grads = window_gradient(model, micro_batches, own_logits, torch.float32).grads
    with autocast():
        grads, _ = with_balance(model, micro_batches, (inputs_of, cfg.train.moe_balance), grads, None)
    return {n: g.detach().to("cpu", torch.float64) for n, g in grads.items()}


def with_balance(model, micro_batches, reading, reference: dict, parts: list | None):
    """The reference (and each micro-batch's share of it) with a mixture of experts' router balancing term added:
    the coefficient × the mean over the window's micro-batches of each one's balancing loss (train.moe_balance=micro,
    as finetune/core/token_mean.py's balance_share weighs it), or × the whole window's (window). Unchanged for a model
    without one. `reading`: (a micro-batch's model inputs, train.moe_balance)."""
    from finetune.core.router_weight import balance_coefficient
    from finetune.testing.reference import balance_gradients, window_balance_gradients

    inputs_of, mode = reading
    gradients = window_balance_gradients if mode == "window" else balance_gradients
    balance = gradients(model, [inputs_of(rows) for rows in micro_batches], balance_coefficient(model))
    if balance is None:
        return reference, parts
    total = {n: g + sum(b[n].to(g.device, g.dtype) for b in balance) for n, g in reference.items()}
    if parts:
        parts = [{n: g + b[n].to(g.device, g.dtype) for n, g in part.items()} for part, b in zip(parts, balance)]
    return total, parts


def weight_deviation(check: StepCheck) -> float:
    return max((abs(w - 1) for w in check.weights or [] if not math.isnan(w)), default=0.0)


def report(checks: list[StepCheck], fixed: float, override: float | None, precision: str, ranks: int):
    """(the printed report, whether every step passed). A step's tolerance: `override` (verify.tolerance) where
    given, else FLOOR_FACTOR × its floor, or `fixed` (the precision's) where that is larger."""

    def step_tolerance(check: StepCheck) -> float:
        return override if override is not None else max(fixed, FLOOR_FACTOR * check.floor)

    weight_tolerance = WEIGHT_TOLERANCES[precision]
    lines = []
    for c in checks:
        clip = f", clipped ×{c.clip:.3g}" if c.clip < 1 else ""
        logged = f", logged {c.logged_loss:.6g}" if c.logged_loss is not None else ""
        lines.append(
            f"step {c.step}: {c.rows} sequences, {c.label_tokens} target tokens from {ranks} "
            f"rank{'s' if ranks != 1 else ''}{clip}; reference loss {c.reference_loss:.6g}{logged}"
        )
        if c.norms:
            lines.append(
                f"  gradient norm before clipping: trainer {c.norms[0]:.6g}, reference {c.norms[1]:.6g} "
                f"(relative difference {abs(c.norms[0] - c.norms[1]) / max(c.norms[1], 1e-30):.1e})"
            )
        floor = f", the brute force in the run's arithmetic {c.floor:.2e}" if c.floor else ""
        lines.append(f"  relative error {c.error:.2e}  (tolerance {step_tolerance(c):.2e}{floor}, {precision})")
        if c.weights is not None:
            shown = " ".join(f"{w:.6f}" for w in c.weights[:16]) + (" …" if len(c.weights) > 16 else "")
            lines.append(
                f"  micro-batch weights (1: each target token counts once): {shown}  (largest deviation "
                f"{weight_deviation(c):.1e}, tolerance {weight_tolerance:g})"
            )
        width = max(len(g) for g in c.groups)
        for group, (error, norm) in c.groups.items():
            mark = "  <-- above tolerance" if error > step_tolerance(c) else ""
            lines.append(f"    {group:<{width}}  {error:.2e}  (‖reference‖ {norm:.3g}){mark}")
    worst = max(checks, key=lambda c: c.error / step_tolerance(c))
    worst_weight = max(weight_deviation(c) for c in checks)
    passed = all(c.error <= step_tolerance(c) for c in checks) and worst_weight <= weight_tolerance
    lines.append(
        f"verify: {'PASS' if passed else 'FAIL'}: largest relative error {worst.error:.2e} (tolerance "
        f"{step_tolerance(worst):.2e}), largest micro-batch weight deviation {worst_weight:.1e} (tolerance "
        f"{weight_tolerance:g}) over {len(checks)} step{'s' if len(checks) != 1 else ''}, {precision}"
    )
    return "\n".join(lines), passed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        if (text := help_asked(argv, COMMAND)) is not None:
            print_page(text)
            return 0
        rest, steps, tolerance = split_args(argv)
        cfg = load_config(rest)
        check_verifiable(cfg)
        default_tolerance, precision = tolerance_for(cfg)
        checks = run(cfg, steps)
        if not is_main_process():
            return 0
        if not checks:
            raise RecipeError("the run made no optimizer step; is the data empty?")
        text, passed = report(checks, default_tolerance, tolerance, precision, world_size())
        print(text, flush=True)
        return 0 if passed else 1

    return run_command(body)  # one `error:` line for what the user can fix, a traceback for a bug
