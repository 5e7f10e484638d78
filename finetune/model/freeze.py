"""What trains: `model.freeze` (module-name prefixes; a frozen module that needs no input gradient runs under
no_grad) and LoRA (`model.lora`, peft). `matches_prefix` is the one rule for module-name prefixes, shared with
`optim.lr_multipliers`."""

from __future__ import annotations

import torch

from finetune.recipe import ModelConfig, RecipeError, first_line

WRAPPERS = {"model", "base_model", "module", "_orig_mod"}  # names that wrap a whole model (VLMs, peft, DDP, compile)


def matches_prefix(name: str, prefix: str) -> bool:
    """`prefix` names `name` or a module above it, counted from the top or after wrapper names: `vision_tower`
    matches `model.vision_tower.encoder…` (LLaVA), `layers.0` matches `model.layers.0.mlp…` but not
    `model.language_model.layers.0…`."""
    parts, want = name.split("."), prefix.split(".")
    for start in range(len(parts)):
        if parts[start : start + len(want)] == want:
            return True
        if parts[start] not in WRAPPERS:
            return False
    return False


def freeze(model: torch.nn.Module, prefixes: list[str]) -> None:
    for prefix in prefixes:
        matched = [p for n, p in model.named_parameters() if matches_prefix(n, prefix)]
        if not matched:
            raise RecipeError(f"model.freeze: '{prefix}' matches no parameter name; use a module-name prefix")
        for p in matched:
            p.requires_grad_(False)
    top = {n for n, _ in model.named_modules() if any(matches_prefix(n, p) for p in prefixes)}
    for name, module in model.named_modules():
        if name in top and name.rpartition(".")[0] not in top:  # outermost frozen modules only
            module.register_forward_pre_hook(_enter_no_grad_if_frozen, with_kwargs=True)
            module.register_forward_hook(_leave_no_grad, with_kwargs=True, always_call=True)


# A frozen module fed inputs that need no gradient (a vision tower fed pixels) runs under no_grad, so autograd keeps
# none of its activations even where something upstream (enable_input_require_grads, checkpointing) would.
# Decided per call: a frozen module between trainable ones still passes gradients through.
def _enter_no_grad_if_frozen(module, args, kwargs):
    inputs = [*args, *kwargs.values()]
    if (
        torch.is_grad_enabled()
        and not any(p.requires_grad for p in module.parameters())
        and not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    ):
        module._finetune_grad_off = True
        torch.set_grad_enabled(False)


def _leave_no_grad(module, args, kwargs, output):
    if module.__dict__.pop("_finetune_grad_off", False):
        torch.set_grad_enabled(True)


def add_lora(model, cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:  # peft's refusals: target modules that match nothing, or that LoRA cannot wrap
        raise RecipeError(f"model.lora.target_modules={list(cfg.lora.target_modules)}: {first_line(e)}") from None
