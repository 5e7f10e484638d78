"""Which loss `TokenNormTrainer` computes, and when it defers to `transformers.Trainer`'s own: the decisions and the
one line each says.

The rule: exact, or exactly `Trainer` with one warning that says so (an error with `require_exact=True`). The loss
kind is decided from the model as transformers decides it (`model.loss_type` through `LOSS_MAPPING`,
finetune/core/heads.py `loss_kind`): causal LM (position t predicts labels[t + 1]), token-level without a shift
(masked LM, token classification), sequence-to-sequence (decoder logits against decoder labels), or one loss per
sample (sequence classification, regression, multiple choice). Any other model (CTC, detection, a plain `nn.Module`
without a `loss_type`) is trained and evaluated by `Trainer`'s own code, unchanged; set
`model.loss_type = "ForCausalLM"` on a plain module to opt in. Then the arguments (TRL's `loss_type`), the class (a
base class's `compute_loss` that ours replaces), and during training what the model and the subclass actually
return. `StepVerdict` (finetune/core/step_verdict.py) keeps the per-step facts; the trainer's hooks call both.

Imports nothing of the package but `heads`.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Trainer

from finetune.core.heads import loss_kind, loss_type_of, unplaced_loss_keys

EXACT_LOSS_TYPES = (None, "nll")  # TRL's SFTConfig.loss_type values whose loss is the token mean ours computes


@dataclass(frozen=True)
class LossChoice:
    """The loss kind this trainer computes (None: `Trainer`'s own), the fallback line where exactness is given up,
    and a note where the choice replaces a base class's loss."""

    kind: str | None
    fallback: str | None = None
    note: str | None = None


def base_compute_loss(trainer_cls: type, ours: type) -> type | None:
    """The base class after `ours` in `trainer_cls`'s MRO whose compute_loss ours replaces (TRL's SFTTrainer in
    `class MySFT(TokenNormTrainer, SFTTrainer)`), or None where that is Trainer's own."""
    mro = trainer_cls.__mro__
    after = mro[mro.index(ours) + 1 :]
    return next((c for c in after if "compute_loss" in vars(c) and c is not Trainer), None)


def choose_loss(trainer_cls: type, ours: type, model, args) -> LossChoice:
    """The loss the trainer computes for `model` and these arguments, or `Trainer`'s own (or a base class's, e.g.
    TRL's `SFTTrainer` with `loss_type="dft"`), unchanged, with one line saying so."""
    base = base_compute_loss(trainer_cls, ours)
    kind = loss_kind(model)
    configured = getattr(args, "loss_type", None)  # TRL's SFTConfig: the base selects its loss by it
    if kind is None:
        return LossChoice(
            None,
            fallback=f"TokenNormTrainer: {type(model).__name__} has loss type {loss_type_of(model)!r}, not a loss "
            "this trainer computes (causal LM, masked LM / token classification, sequence-to-sequence, sequence "
            "classification / regression / multiple choice); it is trained and evaluated by "
            "transformers.Trainer's own loss, unchanged. Set model.loss_type = 'ForCausalLM' (or 'ForMaskedLM') "
            "if its logits are those of a language model.",
        )
    if configured not in EXACT_LOSS_TYPES:
        where = f"{base.__name__}.compute_loss" if base else "transformers.Trainer's own loss"
        return LossChoice(
            None,
            fallback=f"TokenNormTrainer: {trainer_cls.__name__}'s arguments select loss_type={configured!r}, a loss "
            f"this trainer does not compute; it is trained and evaluated by {where} under transformers.Trainer's "
            "own rules, unchanged",
        )
    if terms := unplaced_loss_keys(getattr(model, "config", None)):
        return LossChoice(None, fallback=unplaced_loss_line(type(model).__name__, terms))
    note = None
    if base is not None:
        note = (
            f"TokenNormTrainer: {trainer_cls.__name__} trains the exact token-mean loss in place of "
            f"{base.__name__}.compute_loss, which is not called: what that method logs (TRL's entropy, "
            "mean_token_accuracy, num_tokens) is not logged"
        )
    return LossChoice(kind, note=note)


def empty_window_line(step: int) -> str:
    return (
        f"optimizer step {step}: the accumulation window has no labelled token on any rank; the weights and the "
        "optimizer state are not updated for this step"
    )


def foreign_loss_line(trainer_cls: type) -> str:
    """A subclass's compute_loss returned a loss ours did not compute: what trains it from then on."""
    owner = next(c for c in trainer_cls.__mro__ if "compute_loss" in vars(c))
    return (
        f"TokenNormTrainer: {owner.__name__}.compute_loss returned a loss that TokenNormTrainer.compute_loss "
        "did not compute (the window's exact token mean); it is trained by transformers.Trainer's own rule "
        "for that loss, unchanged (divided by the accumulation steps unless the model takes "
        "num_items_in_batch), and the empty-window veto is off. Call super().compute_loss(...) or pass "
        "compute_loss_func= for the exact token mean"
    )


def misaligned_logits_line(model_name: str, kind: str, logits_shape: tuple | None, targets_shape: tuple) -> str:
    """A model whose logits do not line up with the collator's labels (one that splices positions into the sequence
    and re-aligns the labels inside its forward): Trainer's own loss from this micro-batch on."""
    shape = "no logits" if logits_shape is None else f"logits of shape {logits_shape}"
    return (
        f"TokenNormTrainer: {model_name} (loss kind {kind}) returned {shape} where logits of shape {targets_shape} "
        "+ (classes,) line up with the labels the collator made; it is trained and evaluated by "
        "transformers.Trainer's own loss from this micro-batch on, unchanged (its own forward's loss), not the "
        "exact token mean"
    )


def unplaced_loss_line(model_name: str, terms: list[str]) -> str:
    """A model whose forward adds loss terms this trainer does not compute (named by their config keys or output
    fields): Trainer's own loss, which keeps them."""
    return (
        f"TokenNormTrainer: {model_name} adds {', '.join(terms)} to its loss, terms this trainer does not compute; it "
        "is trained and evaluated by transformers.Trainer's own loss, unchanged (its own forward's loss, those terms "
        "included), not the exact token mean"
    )


def aux_loss_line(model_name: str, key: str) -> str:
    """A model that returns an auxiliary loss (`aux_loss`) without the weight its forward adds it with (`key`: the
    config key that weight is read from): it cannot be placed in the window's objective, so Trainer's own loss (which
    keeps it) from this micro-batch on."""
    return (
        f"TokenNormTrainer: {model_name} returns an auxiliary loss (aux_loss) but its config sets no {key} to weigh it "
        "by; it is trained and evaluated by transformers.Trainer's own loss from this micro-batch on, unchanged (its "
        f"own forward's loss, the auxiliary loss included), not the exact token mean. Set {key} in the model's "
        "config (config.json, or model.config_overrides with model.from_config=true) for the exact token mean"
    )


def eval_loss_not_exact_line(prefix: str, trainer_name: str) -> str:
    """An evaluation whose loss came from somewhere compute_loss never saw (a subclass's prediction_step that calls
    the model itself, as Seq2SeqTrainer's generating step does): said, not passed off as exact."""
    return (
        f"TokenNormTrainer: {prefix}_loss is {trainer_name}'s own per-batch mean, not the exact token mean: its loss "
        "did not come from TokenNormTrainer.compute_loss (a prediction_step or a base class's compute_loss of its "
        "own). Use finetune.TokenNormSeq2SeqTrainer for Seq2SeqTrainer code, or compute the loss with "
        "self.compute_loss."
    )
