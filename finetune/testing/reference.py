"""The reference gradient: the token-mean cross-entropy over a window's rows, each sequence alone and unpadded.

The one brute force that the exactness tests, scripts/exactness.py and `finetune.verify` (through reference_check)
compare training with. It shares no code with what it checks: the loss is written out here with the plain definition
(the mean over every target token of the window of −log softmax(logits[t])[target]), not taken from
`finetune.core.loss`, and each sequence runs alone, so no padding, packing, accumulation or rank can enter it.

- `window_gradient`: the model as it is placed (verify puts it in float64 where it fits, else float32), optionally
  with each micro-batch's share of the gradient.
- `reference_gradient`: a float64 copy of the model with dropout off (what the tests and scripts/exactness.py use).
- `balance_gradients`: a mixture of experts' router balancing term, per micro-batch (it is defined over a
  micro-batch's tokens, as the model computes it): the coefficient × the mean over the window's micro-batches.
  `window_balance_gradients`: the window's (moe_balance="window"): the model's own load_balancing_loss_func over
  every micro-batch's router logits at once, its gradient split by micro-batch through their logits.
- `exact_experts`: a mixture of experts' experts one by one (transformers' eager experts) where its grouped matmul
  has no float64 kernel.
"""

from __future__ import annotations

import copy
import sys
from typing import NamedTuple

import torch
from transformers import PreTrainedConfig

from finetune.core.labels import IGNORE_INDEX


class WindowGradient(NamedTuple):
    grads: dict[str, torch.Tensor]  # per trainable parameter
    loss: float  # the token-mean loss
    targets: int  # the window's target tokens
    parts: list[dict[str, torch.Tensor]] | None  # per micro-batch: its share of `grads` (float32, CPU), if kept


def is_drop_probability(name: str, value) -> bool:
    """A float attribute named for a drop probability (dropout, attention_dropout, resid_pdrop, layerdrop,
    drop_path_rate, …), switched on."""
    return "drop" in name.lower() and isinstance(value, float) and value > 0


def silence_config_dropout(config, seen: set[int]) -> None:
    """Every drop probability of `config` and its nested sub-configs (DBRX's attn_config, a VLM's text_config) to 0:
    modules that read the config in their forward draw nothing."""
    if id(config) in seen:
        return
    seen.add(id(config))
    for name, value in list(vars(config).items()):
        if is_drop_probability(name, value):
            setattr(config, name, 0.0)
        elif isinstance(value, PreTrainedConfig):
            silence_config_dropout(value, seen)


def silence_dropout(model) -> None:
    """Every dropout off: torch's dropout modules, and every drop probability a module copied from its config
    (attention_dropout, SeedOSS's residual_dropout, DBRX's resid_pdrop, …) or reads from it in its forward (the
    config and its sub-configs): the reference is the deterministic gradient."""
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if is_drop_probability(name, value):
                setattr(module, name, 0.0)
        if isinstance(getattr(module, "config", None), PreTrainedConfig):
            silence_config_dropout(module.config, seen)


def target_count(labels, shift: bool = True) -> int:
    return int((torch.as_tensor(labels)[1 if shift else 0 :] != IGNORE_INDEX).sum())


def sequence_loss(logits, labels, shift: bool = True, label_smoothing: float = 0.0):
    """The summed cross-entropy of one sequence's targets. logits: [T, V], in the dtype the loss is computed in.

    shift: position t predicts labels[t + 1] (a causal LM); without it labels[t] (masked LM, token classification, a
    seq2seq decoder's logits). label_smoothing ε: each target's loss is (1 − ε)·(−log p[target]) + ε·mean over classes
    of (−log p).
    """
    labels = torch.as_tensor(labels, device=logits.device)
    if shift:
        logits, labels = logits[:-1], labels[1:]
    picked = labels != IGNORE_INDEX
    log_p = torch.log_softmax(logits[picked], dim=-1)
    losses = -log_p.gather(1, labels[picked].unsqueeze(1)).squeeze(1)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * log_p.mean(dim=-1)
    return losses.sum()


def plain_logits(model, row: dict) -> torch.Tensor:
    """[1, T, V] logits of one row's input_ids alone (the model returns a ModelOutput or a dict)."""
    return model(input_ids=torch.as_tensor(row["input_ids"]).unsqueeze(0))["logits"]


def window_gradient(
    model,
    micro_batches: list[list[dict]],
    logits_of=plain_logits,
    dtype=torch.float64,
    shift: bool = True,
    label_smoothing: float = 0.0,
    keep_parts: bool = False,
) -> WindowGradient:
    """Token-mean cross-entropy gradient over all rows of `micro_batches` (rows: dicts with 1-D input_ids/labels),
    one sequence at a time: each sequence's summed loss over the window's target count, backward alone (the
    gradients add up). `logits_of(model, row)`: that row's [1, T, V] logits; the loss runs in `dtype`."""
    rows = [row for micro_batch in micro_batches for row in micro_batch]
    total = sum(target_count(row["labels"], shift) for row in rows)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    loss_sum, parts, previous = 0.0, [], {}
    for micro_batch in micro_batches:
        for row in micro_batch:
            if not target_count(row["labels"], shift):
                continue
            logits = logits_of(model, row)[0].to(dtype)
            loss = sequence_loss(logits, row["labels"], shift, label_smoothing)
            (loss / total).backward()
            loss_sum += float(loss.detach())
        if keep_parts:  # this micro-batch's share: the running sum now minus before
            now = {
                n: p.grad.float().cpu() if p.grad is not None else torch.zeros(p.shape) for n, p in trainable.items()
            }
            parts.append({n: g - previous[n] if previous else g for n, g in now.items()})
            previous = now
    grads = {n: p.grad.detach() if p.grad is not None else torch.zeros_like(p) for n, p in trainable.items()}
    return WindowGradient(grads, loss_sum / max(total, 1), total, parts if keep_parts else None)


def reference_gradient(model, sequences: list[dict], forward=None, shift: bool = True, label_smoothing: float = 0.0):
    """The float64 token-mean gradient over `sequences` of a copy of `model` with dropout off.

    Returns ({name: float64 grad} for every parameter, zeros where frozen, float64 mean loss). `forward(model, seq)`
    returns [1, T, V] logits for one sequence (default: the model on its input_ids).
    """
    ref = copy.deepcopy(model).to(torch.float64)
    ref.train()
    silence_dropout(ref)
    result = window_gradient(ref, [sequences], forward or plain_logits, torch.float64, shift, label_smoothing)
    grads = {n: result.grads.get(n, torch.zeros_like(p)).detach().clone() for n, p in ref.named_parameters()}
    return grads, result.loss


def relative_error(applied: dict, reference: dict) -> float:
    """‖applied − reference‖ / ‖reference‖ over every parameter of `reference`, in float64."""
    num = sum(float(((applied[n].double() - reference[n]) ** 2).sum()) for n in reference)
    den = sum(float((reference[n] ** 2).sum()) for n in reference)
    return (num / den) ** 0.5


def exact_experts(model) -> None:
    """Run a mixture of experts' experts one by one (transformers' "eager" experts): its grouped matmul has no float64
    kernel, and the loop computes the same sums."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")


def balance_gradients(model, batches: list[dict], coefficient: float | None) -> list[dict] | None:
    """Per micro-batch (`batches`: each as collated, labels left out), the gradient of the coefficient × its router
    balancing loss (the model's `aux_loss` over it) ÷ the number of micro-batches (every rank's): the term a mixture of
    experts adds to its loss, averaged over the window. None where the model returns no balancing loss."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    gradients = []
    for inputs in batches:
        aux = model(**inputs).get("aux_loss")
        if aux is None or not coefficient:
            return None
        grads = torch.autograd.grad(aux * (coefficient / len(batches)), list(trainable.values()), allow_unused=True)
        gradients.append({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(trainable.items(), grads)})
    return gradients


def window_balance_gradients(model, batches: list[dict], coefficient: float | None) -> list[dict] | None:
    """Per micro-batch (`batches` as collated, every rank's), its part of the gradient of the coefficient × the
    window's balancing loss, computed by the model's own `load_balancing_loss_func` over every micro-batch's router
    logits and masks concatenated: the expert frequencies and router probabilities of the whole window. The
    frequencies have no gradient, so the loss is linear in each micro-batch's probabilities: a micro-batch's part is
    the gradient of that loss with every other micro-batch's logits detached. None where the model has no such
    loss."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    balance_loss = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
    outputs = [model(**inputs, output_router_logits=True) for inputs in batches]
    if balance_loss is None or not coefficient or outputs[0].get("router_logits") is None:
        return None
    masks = [inputs.get("attention_mask") for inputs in batches]
    mask = None if any(m is None for m in masks) else torch.cat([m.reshape(-1) for m in masks]).unsqueeze(0)
    layers = list(zip(*(o.router_logits for o in outputs)))  # per layer: each micro-batch's [rows, experts]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    parts = []
    for k in range(len(outputs)):  # the loss of the whole window, only micro-batch k's logits carrying a gradient
        gate_logits = tuple(torch.cat([x if j == k else x.detach() for j, x in enumerate(layer)]) for layer in layers)
        share = coefficient * balance_loss(gate_logits, base.num_experts, base.num_experts_per_tok, mask)
        grads = torch.autograd.grad(share, list(trainable.values()), retain_graph=True, allow_unused=True)
        parts.append({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(trainable.items(), grads)})
    return parts
