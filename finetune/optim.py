"""Optimizers from the recipe: parameter groups, AdamW and SGD from torch, LAMB and LARS.

Groups: biases, norm weights and embeddings get no weight decay (and, in LAMB/LARS, no trust ratio); module-name
prefixes in `optim.lr_multipliers` scale a group's LR. Every group's "lr" is its peak LR; schedules multiply it.
"""

from __future__ import annotations

import torch
from torch import nn

from finetune.config import OptimConfig, RecipeError

NORM_NAMES = ("norm", "layernorm", "rmsnorm", "ln_")


def is_exempt(module: nn.Module, param_name: str) -> bool:
    """Biases, norm weights and embeddings: no weight decay and no layer-wise trust ratio."""
    if param_name.endswith("bias") or isinstance(module, (nn.Embedding, nn.LayerNorm)):
        return True
    owner = type(module).__name__.lower()
    return "norm" in owner or "embedding" in owner


def lr_multiplier(name: str, multipliers: dict[str, float]) -> float:
    """The factor of the longest module-name prefix of `name` in optim.lr_multipliers (1 if none)."""
    matches = [p for p in multipliers if name == p or name.startswith(p + ".")]
    return float(multipliers[max(matches, key=len)]) if matches else 1.0


def param_groups(model: nn.Module, cfg: OptimConfig, lr: float) -> list[dict]:
    """Trainable parameters grouped by (exempt from decay, LR factor)."""
    groups: dict[tuple[bool, float], dict] = {}
    used = set()
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in used:
                continue
            used.add(id(param))
            name = f"{module_name}.{leaf}" if module_name else leaf
            exempt = is_exempt(module, leaf)
            factor = lr_multiplier(name, cfg.lr_multipliers)
            group = groups.setdefault(
                (exempt, factor),
                {"params": [], "names": [], "lr": lr * factor, "weight_decay": 0.0 if exempt else cfg.weight_decay,
                 "trust_ratio": not exempt},
            )
            group["params"].append(param)
            group["names"].append(name)
    unmatched = [p for p in cfg.lr_multipliers if not any(n == p or n.startswith(p + ".") for g in groups.values()
                                                        for n in g["names"])]
    if unmatched:
        raise RecipeError(
            f"optim.lr_multipliers: '{unmatched[0]}' matches no trainable parameter; use a module-name prefix "
            "(e.g. multi_modal_projector)"
        )
    if not groups:
        raise RecipeError("the model has no trainable parameters; check model.freeze and model.lora")
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg, lr)
    for group in groups:
        group.pop("names")
    on_gpu = any(p.is_cuda for g in groups for p in g["params"])
    if cfg.name == "adamw":
        # fused on CUDA, foreach elsewhere: the fastest torch implementation for the device
        impl = {"fused": True} if on_gpu else {"foreach": True}
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, **impl)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, foreach=True)
    raise RecipeError(f"optim.name={cfg.name} is not available yet")
