"""Speed levers on a loaded model's decoder layers, each off by default and kept on only where a GPU measures it
faster and exact (docs/gpu.md): Liger's RMSNorm / SwiGLU / RoPE kernels (`model.liger_kernels`) and torch.compile of
each decoder layer (`train.compile_layers`).

Liger goes on the model instance (`_apply_liger_kernel_to_instance`): the norm and MLP modules of this model get
Liger's forwards, and the family's module-level class names that Liger also rebinds (`LlamaRMSNorm`, `LlamaMLP`, …)
are put back, so a model built later in the process is transformers' own. RoPE has no per-model hook (the attention
reads the family module's `apply_rotary_pos_emb` at each call), so Liger's RoPE stays the family's for the process.
Liger's head and loss (`fused_linear_cross_entropy`, `cross_entropy`) stay off: the trainer's chunked head and exact
token-mean loss are used.
"""

from __future__ import annotations

import sys

from torch import nn

from finetune.recipe import RecipeError

ROPE = "apply_rotary_pos_emb"  # the one family-module name whose Liger binding is kept (see the module docstring)


def use_liger_kernels(model: nn.Module) -> str:
    """Liger's RMSNorm / SwiGLU / RoPE on `model` (a transformers causal LM, before LoRA); the line that says so."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    family = getattr(model.config, "model_type", None)
    if family not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise RecipeError(
            f"model.liger_kernels=true: Liger has no kernels for model type {family!r} "
            f"({type(model).__name__}); set it false"
        )
    module = sys.modules[type(model).__module__]  # transformers' modeling_<family>
    before = dict(vars(module))
    _apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    for name, value in before.items():
        if name != ROPE and vars(module).get(name) is not value:
            setattr(module, name, value)
    return f"liger: {family}'s RMSNorm, SwiGLU and RoPE run Liger's kernels (model.liger_kernels)"


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under peft's wrapper (the model itself without one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder's layers (`model.layers` of the base model; peft's wrapper and a VLM's language model looked
    through), or None."""
    base = base_model(model)
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def compile_layers(model: nn.Module) -> str:
    """torch.compile each decoder layer in place (`module.compile`: parameter names and the state dict unchanged), with
    dynamic shapes: packed and padded micro-batches change length every step. The line that says so."""
    layers = decoder_layers(model)
    if layers is None:
        raise RecipeError(
            f"train.compile_layers=true: {type(model).__name__} has no decoder layers (model.layers) to compile; "
            "set it false"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    return f"compile: {len(layers)} decoder layers compiled in place (dynamic shapes) on their first micro-batch"
