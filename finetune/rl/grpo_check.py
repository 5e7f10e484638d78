"""`check_grpo`: prove on your own GRPO setup (model, rewards, prompts, `GRPOConfig`) that each optimizer step applies
the gradient of its window's objective: the trainer class runs `steps` optimizer steps as given (output, saving and
reporting aside), recording each micro-batch its loss saw and the gradient each step applied, and each step is
compared with the float64 brute force of that window's objective (finetune/rl/grpo_reference.py), at the weights the
step started from, clipped as the step clips (`max_grad_norm`).

One process; the options the brute force does not write out (a high-entropy token mask, the off-policy mask, vLLM's
importance ratios, sequence-level importance sampling, a liger loss) are refused with one line naming the option.
"""

from __future__ import annotations

import copy
import tempfile
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM

from finetune.rl.grpo_reference import KNOWN, Objective, window_objective_gradient
from finetune.rl.grpo_toy import StepRecorder, recording
from finetune.testing.reference import relative_error
from finetune.testing.toy import model_at

TOLERANCE = 1e-5  # float32 training against float64 (the tests measure 1.4e-7 to 4.5e-7 on the tiny policy)


class StepCheck(NamedTuple):
    step: int
    relative_error: float
    loss_tokens: int  # the window's loss-mask tokens
    passed: bool


def unchecked_option(args) -> str | None:
    """The first setting the brute force cannot reproduce, as one line saying what to change; None if none."""
    refused = {
        "loss_type": args.loss_type not in KNOWN,
        "top_entropy_quantile": args.top_entropy_quantile < 1.0,
        "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
        "use_vllm": args.use_vllm,
        "importance_sampling_level": args.importance_sampling_level != "token",
    }
    for key, bad in refused.items():
        if bad:
            return f"check_grpo: {key}={getattr(args, key)!r} is not written out in the brute force: check without it"
    return None


def check_grpo(
    trainer_cls, model, reward_funcs, args, train_dataset, processing_class=None, steps: int = 1, tolerance=TOLERANCE
) -> list[StepCheck]:
    """Train `steps` optimizer steps of `trainer_cls` (a GRPOTrainer class) and check each against float64.
    `model`: a folder / hub id or a causal LM instance (its initial weights are copied before training)."""
    if (line := unchecked_option(args)) is not None:
        raise ValueError(line)
    initial = AutoModelForCausalLM.from_pretrained(model) if isinstance(model, str) else copy.deepcopy(model)
    recorder = StepRecorder()
    with tempfile.TemporaryDirectory() as out:
        run_args = copy.deepcopy(args)  # not dataclasses.replace: GRPOConfig refuses its own derived fields again
        run_args.output_dir, run_args.max_steps, run_args.save_strategy, run_args.report_to = out, steps, "no", []
        trainer = recording(trainer_cls)(
            model=model, reward_funcs=reward_funcs, args=run_args, train_dataset=train_dataset,
            processing_class=processing_class, callbacks=[recorder],
        )  # fmt: skip
        trainer.train()
    objective, accumulation = Objective.of(run_args), run_args.gradient_accumulation_steps
    checks = []
    for k, grads in enumerate(recorder.grads):
        window = trainer.seen[k * accumulation : (k + 1) * accumulation]
        reference = clipped(window_objective_gradient(model_at(initial, recorder.before[k]), window, objective), args)
        error = relative_error({n: grads[n] for n in reference}, reference)
        tokens = sum(int(b["completion_mask"].sum()) for b in window)
        checks.append(StepCheck(k + 1, error, tokens, error <= tolerance))
    return checks


def clipped(grads: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """The gradient as a step with `args.max_grad_norm` clips it (torch's rule: × max_norm ÷ (norm + 1e-6), ≤ 1)."""
    if not args.max_grad_norm or args.max_grad_norm <= 0:
        return grads
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    factor = min(1.0, args.max_grad_norm / (norm + 1e-6))
    return {n: g * factor for n, g in grads.items()}
