"""Layers that carry state along the sequence: linear attention (Gated DeltaNet: Qwen3.5, Qwen3-Next; Kimi Linear,
MiniMax), short convolutions (LFM2) and Mamba mixers (Granite 4, Falcon-H1, Jamba, Bamba, Nemotron-H, Zamba 2).

In a packed row their state and convolution window run on from one sequence into the next unless the kernel is
given the boundaries (flash-linear-attention's `cu_seqlens`, causal-conv1d's and mamba-ssm's `seq_idx`); transformers'
torch paths either refuse packed rows with a traceback or silently mix the sequences, and with the kernels installed
it passes the bounds to the gated delta rule but not to the convolution before it (docs/batching.md). So packing such
a model is refused in one line, from its config, before its weights load, on every device; padded rows (right
padding, a mask) and token budgets are exact. Imports the recipe only.
"""

from __future__ import annotations

from finetune.recipe import ModelConfig, RecipeError, RunPlan

ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe"}
# config keys that only a stateful mixer has (the Mamba, SSM and short-convolution families name theirs so)
STATE_KEYS = ("mamba_", "ssm_", "conv_L_cache", "linear_conv_kernel_dim", "linear_attn_")


def stateful_mixers(config) -> list[str]:
    """The kinds of this model's sequence-carrying layers, from its (text) config; [] for attention alone."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or []
    kinds = sorted({kind for kind in layers if isinstance(kind, str)} - ATTENTION_LAYERS)
    if not kinds and any(key.startswith(STATE_KEYS) for key in text.to_dict()):  # no layer list names them
        kinds = ["state-carrying"]
    return kinds


def check_packed_mixers(model: ModelConfig, plan: RunPlan, config) -> None:
    """Refuse packed rows (training or evaluation) for a model whose layers would carry state across them."""
    asked = ["data.batching"] if plan.training.mode == "packed" else []
    if plan.evaluation is not None and plan.evaluation.mode == "packed":
        asked.append("eval.batching")
    kinds = stateful_mixers(config) if asked else []
    if kinds:
        raise RecipeError(
            f"model.name_or_path={model.name_or_path}: {' and '.join(k + '=packed' for k in asked)} would carry the "
            f"state of its {', '.join(kinds)} layers from one sequence of a packed row into the next (their state "
            f"and convolution window run along the row); set {plan.instead_of_packing}"
        )
