"""The float64 brute force of one optimizer window's GRPO objective, written from its definition and sharing no code
with the trainer: each sequence runs alone and unpadded (its prompt tokens, then its completion tokens), and the
window's loss is formed over all of its micro-batches at once.

Given what the trainer used (each micro-batch's prompts, completions, masks, advantages, and the old and reference
log-probabilities it held, fixed), `window_objective_gradient` returns the gradient of

- token level (dapo, bnpo, cispo): Σ over the window's loss-mask tokens of the per-token loss ÷ their number;
- grpo, sapo: the mean over the window's sequences of each one's summed per-token loss ÷ its own loss tokens;
- dr_grpo: Σ per-token loss ÷ (the window's sequences × max_completion_length); luspo: the mean of sequence sums;

minus the entropy coefficient × the window's token mean of the entropy. The per-token loss (`policy_term`; cispo's and
sapo's as TRL defines them) is the clipped surrogate
−min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), r = exp(log p − log p_old) (p_old: the held old log-probabilities, else
log p itself without gradient), plus β × (exp(log p_ref − log p) − (log p_ref − log p) − 1), × r where the KL is
bias-corrected (TRL's default); with two-sided clipping δ the unclipped term takes min(r, δ).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

SURROGATE = ("dapo", "bnpo", "grpo", "dr_grpo", "luspo")  # the clipped surrogate
KNOWN = (*SURROGATE, "cispo", "sapo")


@dataclass(frozen=True)
class Objective:
    """The GRPO objective's settings (GRPOConfig's names)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    max_completion_length: int = 256
    entropy_coef: float = 0.0
    bias_correction_kl: bool = True  # the KL term × r (TRL's use_bias_correction_kl)
    delta: float | None = None  # two-sided clipping: r ≤ delta in the unclipped term
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # sapo's τ for positive, other advantages

    @classmethod
    def of(cls, args) -> Objective:
        high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # TRL's default: symmetric
        return cls(
            args.loss_type, args.beta, args.epsilon, high, args.temperature,
            args.max_completion_length, args.entropy_coef, args.use_bias_correction_kl, args.delta,
            (args.sapo_temperature_pos, args.sapo_temperature_neg),
        )  # fmt: skip


def sequences_of(micro_batch: dict) -> list[dict]:
    """Each row of a prepared micro-batch alone: its token ids unpadded, where its completion starts, its loss mask
    and held values over the completion's attended positions."""
    rows = []
    mask = micro_batch["completion_mask"]
    loss_mask = mask * micro_batch["tool_mask"] if "tool_mask" in micro_batch else mask
    advantages = micro_batch["advantages"].reshape(mask.shape[0], -1)
    for i in range(mask.shape[0]):
        prompt = micro_batch["prompt_ids"][i][micro_batch["prompt_mask"][i].bool()]
        kept = mask[i].bool()
        held = {k: micro_batch[k][i][kept] for k in ("old_per_token_logps", "ref_per_token_logps") if k in micro_batch}
        rows.append(
            dict(
                ids=torch.cat([prompt, micro_batch["completion_ids"][i][kept]]), start=len(prompt),
                loss_mask=loss_mask[i][kept].double(), advantage=float(advantages[i, 0]), **held,
            )
        )  # fmt: skip
    return rows


def token_terms(model, row: dict, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token entropy) over one row's completion positions, in the model's dtype."""
    if len(row["ids"]) == row["start"]:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty
    logits = model(input_ids=row["ids"].unsqueeze(0)).logits[0, row["start"] - 1 : -1] / objective.temperature
    log_p = torch.log_softmax(logits, dim=-1)
    logp = log_p.gather(1, row["ids"][row["start"] :].unsqueeze(1)).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    old = row["old_per_token_logps"].double() if "old_per_token_logps" in row else logp.detach()
    ratio = torch.exp(logp - old)
    a = row["advantage"]
    loss = policy_term(objective, logp, ratio, a)
    if objective.beta:
        diff = row["ref_per_token_logps"].double() - logp
        kl = torch.exp(diff) - diff - 1
        loss = loss + objective.beta * (kl * ratio if objective.bias_correction_kl else kl)
    return loss, entropy


def policy_term(objective: Objective, logp: torch.Tensor, ratio: torch.Tensor, a: float) -> torch.Tensor:
    """The per-token policy loss of one row of advantage `a`: the clipped surrogate; cispo's −min(r, ε_high)·A·log p
    (the weight without gradient); sapo's soft gate −σ(τ(r − 1))·4/τ·A."""
    if objective.loss_type == "cispo":
        return -ratio.clamp(max=objective.epsilon_high).detach() * a * logp
    if objective.loss_type == "sapo":
        tau = objective.sapo_temperatures[0] if a > 0 else objective.sapo_temperatures[1]
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
    clipped = ratio.clamp(1 - objective.epsilon_low, 1 + objective.epsilon_high)
    unclipped = ratio if objective.delta is None else ratio.clamp(max=objective.delta)
    return -torch.minimum(unclipped * a, clipped * a)


def window_objective(model, micro_batches: list[dict], objective: Objective) -> torch.Tensor:
    """The window's objective (see the module docstring), differentiable in `model`'s parameters."""
    if objective.loss_type not in KNOWN:
        raise ValueError(f"loss_type={objective.loss_type!r}: the brute force knows {', '.join(KNOWN)}")
    rows = [row for batch in micro_batches for row in sequences_of(batch)]
    tokens = sum(float(row["loss_mask"].sum()) for row in rows)
    total, entropy = 0.0, 0.0
    for row in rows:
        loss, h = token_terms(model, row, objective)
        summed = (loss * row["loss_mask"]).sum()
        if objective.loss_type in ("grpo", "sapo"):
            summed = summed / max(float(row["loss_mask"].sum()), 1.0) * tokens / len(rows)
        elif objective.loss_type == "dr_grpo":
            summed = summed * tokens / (len(rows) * objective.max_completion_length)
        elif objective.loss_type == "luspo":
            summed = summed * tokens / len(rows)
        total = total + summed
        entropy = entropy + (h * row["loss_mask"]).sum()
    return (total - objective.entropy_coef * entropy) / max(tokens, 1.0)


def window_objective_gradient(model, micro_batches: list[dict], objective: Objective) -> dict[str, torch.Tensor]:
    """{name: float64 gradient} of the window's objective at a float64 copy of `model` (a plain causal LM)."""
    ref = copy.deepcopy(model).to(torch.float64).train()
    for module in ref.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batches = [{k: v.detach().cpu() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in micro_batches]
    window_objective(ref, batches, objective).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in ref.named_parameters()}
