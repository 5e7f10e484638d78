"""A mixture of experts' router balancing loss over the whole accumulation window (`moe_balance="window"`). Pure
functions (torch only).

transformers' `load_balancing_loss_func` (Switch style) over the (layer, token) rows it is given, padding masked:
f_e = the top-k routing slots that went to expert e ÷ rows, P_e = the router probability of e summed ÷ rows, loss
= N_E Σ_e f_e P_e. Per micro-batch (`"micro"`) it is the model's own `aux_loss`, averaged over the window
(token_mean.balance_share). Over the window (the global-batch balancing of the Qwen team and Megatron-Core), f and P
count every micro-batch of the window on every rank, then the loss is taken once:

1. `routing_counts`: before the window's first backward, a no-grad forward of each micro-batch gives its routing
   (f has no gradient); summed over the window and the data-parallel ranks with the rows.
2. `window_share`: micro-batch k contributes coefficient × N_E Σ_e f_e · (its probability sums of e) ÷ rows, × the
   data-parallel size (DDP averages over ranks): the ranks' average of the K shares' gradients is the window loss's.

`layer_counts` gives each layer's routing for the logs (`RouterMeter` in finetune/core/meter.py): a collapsing
router shows as one expert's load far above the mean.
"""

from __future__ import annotations

import torch

from finetune.core.heads import text_config_of
from finetune.core.router_weight import balance_coefficient, config_coefficient


def experts_of(model) -> tuple[int, int] | None:
    """(experts, experts per token) as the model's forward passes them to its balancing loss; None where unknown."""
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if isinstance(experts, int) and isinstance(top_k, int) else None


def has_router_loss(model) -> bool:
    """Whether the model's forward adds a router balancing loss: a mixture of experts with output_router_logits on
    and a weight for it (router_weight.py), whose expert counts are known."""
    config = getattr(model, "config", None)
    on = bool(getattr(config, "output_router_logits", False))
    return on and balance_coefficient(model) is not None and experts_of(model) is not None


def config_router_loss(config) -> bool:
    """Whether a model built from `config` adds a router balancing loss (output_router_logits on and a weight for it,
    under the config key its class's forward reads), read before its weights load."""
    text = text_config_of(config)
    on = bool(getattr(text, "output_router_logits", False))
    return on and config_coefficient(config, text) is not None


def _rows_mask(router_logits: tuple, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    return attention_mask.reshape(-1).to(router_logits[0].device, torch.float32)


def routing_counts(router_logits: tuple, attention_mask: torch.Tensor | None, experts: int, top_k: int) -> torch.Tensor:
    """[experts + 1] float64: the top-k slots each expert got over every layer's unmasked rows, then the rows."""
    mask = _rows_mask(router_logits, attention_mask)
    rows = sum(layer.shape[0] for layer in router_logits) if mask is None else len(router_logits) * mask.sum()
    slots = layer_counts(router_logits, attention_mask, experts, top_k).sum(dim=0)
    return torch.cat([slots, slots.new_tensor([float(rows)]) if mask is None else rows.double().reshape(1)])


def layer_counts(router_logits: tuple, attention_mask: torch.Tensor | None, experts: int, top_k: int) -> torch.Tensor:
    """[layers, experts] float64: the top-k slots each expert got in each layer over the unmasked rows, chosen as
    transformers' load_balancing_loss_func chooses them (the top-k of the router probabilities)."""
    mask = _rows_mask(router_logits, attention_mask)
    counts = torch.zeros(len(router_logits), experts, dtype=torch.float64, device=router_logits[0].device)
    for layer, logits in enumerate(router_logits):
        chosen = torch.topk(torch.softmax(logits.detach().float(), dim=-1), top_k, dim=-1).indices.reshape(-1)
        weights = torch.ones_like(chosen, dtype=torch.float64) if mask is None else mask.repeat_interleave(top_k)
        counts[layer].scatter_add_(0, chosen, weights.double())
    return counts


def probability_sums(router_logits: tuple, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[experts]: the router probabilities summed over every layer's unmasked rows (with their gradient)."""
    mask = _rows_mask(router_logits, attention_mask)
    total = 0
    for layer in router_logits:
        probabilities = torch.softmax(layer.float(), dim=-1)
        total = total + (probabilities if mask is None else probabilities * mask.unsqueeze(-1)).sum(dim=0)
    return total


def window_share(
    prob_sums: torch.Tensor, window_counts: torch.Tensor, coefficient: float, data_parallel_size: int
) -> torch.Tensor:
    """One micro-batch's share of coefficient × the window's balancing loss (`window_counts`: routing_counts summed
    over the window's micro-batches and ranks)."""
    experts = prob_sums.shape[-1]
    rows = window_counts[experts].clamp(min=1)
    fractions = (window_counts[:experts] / rows).to(prob_sums.device, prob_sums.dtype)
    return coefficient * experts * (fractions * prob_sums).sum() / rows.to(prob_sums.dtype) * data_parallel_size
