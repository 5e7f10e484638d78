"""Optimizers from the recipe: parameter groups, AdamW and SGD from torch, LAMB and LARS, bitsandbytes' 8-bit and
paged AdamW.

Groups: biases, norm weights and embeddings get no weight decay (and, in LAMB/LARS, no trust ratio); module-name
prefixes in `optim.lr_multipliers` scale a group's LR. Every group's "lr" is its peak LR; schedules multiply it.

LAMB and LARS are written on `torch._foreach_*` ops (one kernel per op over a whole group where the device allows)
and take trust ratios as 0-dim tensors, so a step never synchronizes with the GPU. Their state is per parameter, in
the parameter's dtype, and round-trips through `state_dict()` like torch's own optimizers (resume). Under FSDP2 the
foreach norms of DTensor shards are whole-tensor norms, so trust ratios equal the unsharded ones.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from finetune.model.freeze import matches_prefix
from finetune.recipe import OptimConfig, RecipeError, choice_error

NORM_NAMES = ("norm", "layernorm", "rmsnorm", "ln_")
# optim.name -> bitsandbytes' class: AdamW with 8-bit blockwise-quantized states (tensors of 4096+ elements; smaller
# ones keep 32-bit states), and paged states (CUDA unified memory; plain host tensors on a CPU)
BNB_ADAMW = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "paged_adamw": "PagedAdamW"}
# bitsandbytes' warning at a paged optimizer's first step on a CPU (states unpaged there): `optimizer_line` says it
PAGED_ON_CPU = r"Paged optimizers are not supported on CPU\. Falling back to non-paged optimizer behavior\."


def is_exempt(module: nn.Module, param_name: str) -> bool:
    """Biases, norm weights and embeddings: no weight decay and no layer-wise trust ratio."""
    if param_name.endswith("bias") or isinstance(module, (nn.Embedding, nn.LayerNorm)):
        return True
    owner = type(module).__name__.lower()
    return "norm" in owner or "embedding" in owner


def lr_multiplier(name: str, multipliers: dict[str, float]) -> float:
    """The factor of the longest module-name prefix of `name` in optim.lr_multipliers (1 if none); prefixes match as
    model.freeze's do (`multi_modal_projector` finds `model.multi_modal_projector.…`, also inside peft)."""
    matches = [p for p in multipliers if matches_prefix(name, p)]
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
                {
                    "params": [],
                    "names": [],
                    "lr": lr * factor,
                    "weight_decay": 0.0 if exempt else cfg.weight_decay,
                    "trust_ratio": not exempt,
                },
            )
            group["params"].append(param)
            group["names"].append(name)
    unmatched = [
        p for p in cfg.lr_multipliers if not any(matches_prefix(n, p) for g in groups.values() for n in g["names"])
    ]
    if unmatched:
        raise RecipeError(
            f"optim.lr_multipliers: '{unmatched[0]}' matches no trainable parameter; use a module-name prefix "
            "(e.g. multi_modal_projector)"
        )
    if not groups:
        raise RecipeError("the model has no trainable parameters; check model.freeze and model.lora")
    # the groups at the recipe's own LR first: the Trainer logs the first group's LR as the run's learning_rate
    return sorted(groups.values(), key=lambda group: group["lr"] != lr)


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms, accumulated in float32 at least (bf16/fp16 parameters keep a precise trust ratio)."""
    dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    return torch._foreach_norm(tensors, 2, dtype=dtype)


def _trust_ratio(
    weight_norms: list[torch.Tensor], other_norms: list[torch.Tensor], numerator_coef: float, decay: float
) -> torch.Tensor:
    """coef·‖w‖ / (‖x‖ + decay·‖w‖) per tensor, and 1 where either norm is zero (a zero-initialized weight moves)."""
    w, x = torch.stack(weight_norms), torch.stack(other_norms)
    ratio = numerator_coef * w / (x + decay * w)
    return torch.where((w > 0) & (x > 0), ratio, torch.ones_like(ratio))


class _LayerwiseOptimizer(torch.optim.Optimizer):
    """Shared plumbing: closure, gradient gathering, lazily created per-parameter state."""

    state_keys: tuple[str, ...] = ()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # on the CPU, as torch keeps it: reading it never syncs
                    for key in self.state_keys:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
            self._update(group, params, [p.grad for p in params], [self.state[p] for p in params])
        return loss

    def _update(self, group: dict, params: list, grads: list, states: list[dict]) -> None:
        raise NotImplementedError


class LAMB(_LayerwiseOptimizer):
    """LAMB, You et al. 2019 ("Large Batch Optimization for Deep Learning", Algorithm 2), with φ the identity:

        m ← β1·m + (1−β1)·g          v ← β2·v + (1−β2)·g²          (bias-corrected: m̂, v̂)
        u = m̂ / (√v̂ + ε) + λ·w        w ← w − lr · ‖w‖/‖u‖ · u

    The trust ratio ‖w‖/‖u‖ is per parameter tensor, and 1 where either norm is zero. Groups with
    `trust_ratio: False` (biases, norms, embeddings; weight_decay 0 there) take the plain Adam step lr·u.
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        trust_ratio: bool = True,
    ):
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, trust_ratio=trust_ratio)
        )

    def _update(self, group, params, grads, states):
        beta1, beta2 = group["betas"]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        # m̂/(√v̂ + ε) = m / (bc1·√v/√bc2 + bc1·ε): both bias corrections folded into one scale and one shift.
        corrections = [(1 - beta1 ** s["step"].item(), 1 - beta2 ** s["step"].item()) for s in states]
        update = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_mul_(update, [bc1 / math.sqrt(bc2) for bc1, bc2 in corrections])
        torch._foreach_add_(update, [bc1 * group["eps"] for bc1, _ in corrections])
        torch._foreach_div_(update, exp_avg)
        torch._foreach_reciprocal_(update)  # update = m / denominator, without a second allocation
        if group["weight_decay"]:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        if group["trust_ratio"]:
            ratio = _trust_ratio(_norms(params), _norms(update), 1.0, 0.0)
            torch._foreach_addcmul_(params, update, (ratio * -group["lr"]).unbind())  # w += (−lr·ratio)·u, one pass
        else:
            torch._foreach_add_(params, update, alpha=-group["lr"])


class LARS(_LayerwiseOptimizer):
    """LARS, You et al. 2017 ("Large Batch Training of Convolutional Networks", Algorithm 1):

        local_lr = η·‖w‖ / (‖g‖ + β·‖w‖)      v ← m·v + lr·local_lr·(g + β·w)      w ← w − v

    η is `trust_coefficient`, β the weight decay, m the momentum; as in the paper the (scheduled) LR is applied
    inside the momentum buffer. local_lr is per parameter tensor, and 1 where ‖w‖ or ‖g‖ is zero. Groups with
    `trust_ratio: False` take v ← m·v + lr·g (plain momentum SGD, no decay).
    """

    state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        trust_ratio: bool = True,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                trust_coefficient=trust_coefficient,
                trust_ratio=trust_ratio,
            ),
        )

    def _update(self, group, params, grads, states):
        lr, decay = group["lr"], group["weight_decay"]
        buffers = [s["momentum_buffer"] for s in states]
        torch._foreach_mul_(buffers, group["momentum"])
        # v += s·g (+ s·β·w), s = lr·local_lr: accumulated straight into the buffer, no temporary the size of the model
        if not group["trust_ratio"]:
            torch._foreach_add_(buffers, grads, alpha=lr)
            if decay:
                torch._foreach_add_(buffers, params, alpha=lr * decay)
        else:
            local_lr = _trust_ratio(_norms(params), _norms(grads), group["trust_coefficient"], decay)
            torch._foreach_addcmul_(buffers, grads, (local_lr * lr).unbind())
            if decay:
                torch._foreach_addcmul_(buffers, params, (local_lr * (lr * decay)).unbind())
        torch._foreach_sub_(params, buffers)


def step_implementation(on_gpu: bool, grad_scaled: bool) -> dict:
    """torch's fastest implementation for the device: fused on a GPU, foreach elsewhere; never fused under a GradScaler
    (fp16). GradScaler always calls a fused optimizer's step() (the kernel skips an overflow step itself), so
    accelerate would never report the skip and the LR schedule would advance on overflow steps; a foreach step is not
    called at all on an overflow, which accelerate sees."""
    return {"fused": True} if on_gpu and not grad_scaled else {"foreach": True}


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float, grad_scaled: bool = False) -> torch.optim.Optimizer:
    """The recipe's optimizer over `param_groups`; every group starts at its peak LR. `grad_scaled`: the gradients
    go through a GradScaler (fp16), see `step_implementation`."""
    groups = param_groups(model, cfg, lr)
    for group in groups:
        group.pop("names")
    on_gpu = any(p.is_cuda for g in groups for p in g["params"])
    impl = step_implementation(on_gpu, grad_scaled)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, **impl)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, **impl)
    if cfg.name == "lamb":
        return LAMB(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "lars":
        return LARS(groups, lr=lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient)
    if cfg.name in BNB_ADAMW:
        import bitsandbytes as bnb

        if cfg.name.startswith("paged") and not on_gpu:  # the start-up line said it runs unpaged
            warnings.filterwarnings("ignore", PAGED_ON_CPU, UserWarning, r"bitsandbytes\.optim\.optimizer")
        return getattr(bnb.optim, BNB_ADAMW[cfg.name])(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps)
    raise choice_error("optim.name", cfg.name)


def optimizer_line(cfg: OptimConfig, on_gpu: bool, grad_scaled: bool = False) -> str:
    """`optimizer: adamw (torch AdamW, foreach)`: the optimizer as `build_optimizer` makes it on this device; a paged
    bitsandbytes AdamW on a CPU runs unpaged, said here (bitsandbytes' own warning of it is filtered)."""
    impl = next(iter(step_implementation(on_gpu, grad_scaled)))
    if cfg.name in ("adamw", "sgd"):
        return f"optimizer: {cfg.name} (torch {'AdamW' if cfg.name == 'adamw' else 'SGD'}, {impl})"
    if cfg.name in ("lamb", "lars"):
        return f"optimizer: {cfg.name} ({cfg.name.upper()} on torch's foreach ops, finetune/training/optim.py)"
    states = "8-bit states for tensors of 4,096+ elements" if cfg.name.endswith("8bit") else "32-bit states"
    line = f"optimizer: {cfg.name} (bitsandbytes {BNB_ADAMW[cfg.name]}, {states}"
    if cfg.name.startswith("paged"):
        paged = "states of 100k+ elements paged to host memory when the GPU runs short"
        line += f"; {paged}" if on_gpu else "; paging is CUDA-only, on this CPU it runs unpaged"
    return line + ")"
