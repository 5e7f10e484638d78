"""What trains, in start-up lines read from the loaded model (not the recipe): its weights' dtype or bitsandbytes
quantization (4-bit NF4/FP4 with or without double quantization and the compute dtype, or 8-bit LLM.int8), and its
LoRA adapter as peft holds it (rank, alpha, dropout, the layers it wraps)."""

from __future__ import annotations

from collections import Counter

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtypes_text(params) -> str:
    """`float32`, or `bfloat16 (1,234), float32 (56)` where the parameters hold several dtypes (counted at full size:
    ZeRO-3's ds_numel for a partitioned one)."""
    counts = Counter()
    for p in params:
        counts[dtype_name(p.dtype)] += getattr(p, "ds_numel", p.numel())
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{name} ({n:,})" for name, n in counts.most_common())


def quantized_layers(model) -> list[torch.nn.Module]:
    """The bitsandbytes 4-bit and 8-bit linear layers of a model that transformers loaded quantized ([] otherwise;
    bitsandbytes is imported only then)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "hf_quantizer", None) is None:
        return []
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def quantization_text(layers: list[torch.nn.Module]) -> str:
    """`4-bit NF4, double quantization, compute dtype float32` or `8-bit LLM.int8, outlier threshold 6.0`: how the
    layers hold their weights, from the layers themselves (their quant_state and compute dtype)."""
    import bitsandbytes as bnb

    four = [m for m in layers if isinstance(m, bnb.nn.Linear4bit)]
    if not four:
        thresholds = sorted({float(m.state.threshold) for m in layers})
        return f"8-bit LLM.int8, outlier threshold {'/'.join(f'{t:g}' for t in thresholds)}"
    states = [m.weight.quant_state for m in four]
    kinds = "/".join(sorted({s.quant_type.upper() for s in states}))
    double = "double quantization" if all(s.nested for s in states) else "no double quantization"
    compute = "/".join(sorted({dtype_name(m.compute_dtype) for m in four if m.compute_dtype is not None}))
    return f"4-bit {kinds}, {double}, compute dtype {compute or 'of the input'}"


def weights_line(model) -> str:
    """`weights: float32`, or for a quantized base `weights: 4-bit NF4, double quantization, compute dtype float32
    (bitsandbytes) in 14 linear layers; the other 98,432 frozen parameters in float32`."""
    layers = quantized_layers(model)
    if not layers:
        return f"weights: {dtypes_text(model.parameters())}"
    inside = {id(p) for m in layers for p in m.parameters(recurse=False)}
    others = [p for p in model.parameters() if id(p) not in inside and not p.requires_grad]
    count = sum(getattr(p, "ds_numel", p.numel()) for p in others)
    line = f"weights: {quantization_text(layers)} (bitsandbytes) in {len(layers)} linear layers"
    return line + (f"; the other {count:,} frozen parameters in {dtypes_text(others)}" if others else "")


def adapter_line(model) -> str | None:
    """`LoRA: rank 16, alpha 32 (scale 2), dropout 0 on 14 layers (down_proj, gate_proj, …); adapters in float32`, as
    peft holds the adapter; None without one."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None or not hasattr(config, "lora_alpha"):
        return None
    from peft.tuners.lora import LoraLayer

    wrapped = [name for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    names = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in wrapped}))
    adapters = [p for name, p in model.named_parameters() if ".lora_" in name]
    return (
        f"LoRA: rank {config.r}, alpha {config.lora_alpha} (scale {config.lora_alpha / config.r:g}), dropout "
        f"{config.lora_dropout:g} on {len(wrapped)} layers ({names}); adapters in {dtypes_text(adapters)}"
    )
