"""Tiny random decoder models of each family transformers ships, at the debug recipe's size (recipes/debug.yaml: its
config_overrides apply on top: hidden 64, intermediate 128, 2 layers, 4 heads, 2 key/value heads), saved with a
tokenizer as a hub model's folder is; the debug recipe builds the model from the folder's config (model.from_config).
Used by tests/test_families.py, tests/test_sequence_mixers.py and scripts/family_matrix.py (docs/models.md).

Each family's kwargs keep what the override cannot: two layer types, an explicit head size where the family's default
is large, a sliding window shorter than the rows (so the window is exercised), a few small experts, and the router
balancing loss on (`output_router_logits`, a coefficient large enough to matter) where the family has one.
`REFUSED`: the cases whose packed rows are refused in one line, and the pattern of that line."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

VOCAB = "<the tokenizer's vocabulary size>"  # a value family_folder replaces with len(tokenizer)
WINDOW = 16  # sliding window: shorter than the debug rows (data.max_length=64)
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.1)
SLIDING_THEN_FULL = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
GATED_DELTANET = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    head_dim=16,
)
SMALL_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
DEEPSEEK_EXPERTS = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 mixture of experts
)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, **SMALL_EXPERTS, **ROUTER_LOSS),
    "qwen3_5_text": GATED_DELTANET,
    "qwen3_5_moe_text": dict(**GATED_DELTANET, **SMALL_EXPERTS, shared_expert_intermediate_size=32, **ROUTER_LOSS),
    "qwen3_next": dict(**GATED_DELTANET, **SMALL_EXPERTS, shared_expert_intermediate_size=32, **ROUTER_LOSS),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, **ROUTER_LOSS),
    "gpt_oss": dict(
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=131072,  # its YaRN factor 32 × original 4096: the ratio its rope checks
        **SLIDING_THEN_FULL,
        **ROUTER_LOSS,
    ),
    "deepseek_v3": dict(
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        **DEEPSEEK_EXPERTS,
    ),
    "glm4_moe": dict(head_dim=16, **DEEPSEEK_EXPERTS),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, **ROUTER_LOSS),  # its router samples in training
    "jetmoe": dict(  # experts in attention and MLP; its weight is aux_loss_coef
        num_local_experts=4, num_experts_per_tok=2, kv_channels=16, output_router_logits=True, aux_loss_coef=0.1
    ),
    "dbrx": dict(  # its weight is ffn_config.moe_loss_weight
        ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2, moe_loss_weight=0.1),
        # DbrxAttention reads attn_config.rope_theta (unused) and clamps q, k, v by clip_qkv, which must be set
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
        output_router_logits=True,
    ),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, **SLIDING_THEN_FULL),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, **SLIDING_THEN_FULL),
    "gemma4_text": dict(
        head_dim=16,
        global_head_dim=32,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        **SLIDING_THEN_FULL,
    ),
    "mistral": dict(sliding_window=WINDOW),
    "phi3": {},
    "seed_oss": dict(head_dim=16),  # its config's attention and residual dropout (0.1) kept: verify turns them off
    "olmo2": {},
    "olmo3": SLIDING_THEN_FULL,
    "smollm3": dict(no_rope_layers=[1, 0], layer_types=["full_attention", "full_attention"]),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1], block_ff_dim=128, conv_L_cache=3),
    "bamba": dict(
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=32,  # mamba_expand 2 × hidden 64 = heads × head size
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=16,
    ),
}

# recipe keys a family needs on top of the debug recipe's (its config_overrides win over the folder's config)
RECIPE_KEYS: dict[str, list[str]] = {
    # multi-head latent attention: keys and values have every head (no grouping), as DeepSeek-V3's own config says;
    # the debug recipe's 2 key/value heads would make transformers' DeepseekV3Attention repeat them (8 key heads
    # against 4 query heads) wherever sdpa gets a mask, as packed rows do: refused by the packed probe
    "deepseek_v3": ["model.config_overrides.num_key_value_heads=4"],
}
DEBUG = ["recipe=recipes/debug.yaml", "data.limit=16", "data.max_length=64", "log.wandb_mode=disabled"]


def verify_argv(folder: Path, family: str, batching: str) -> list[str]:
    """finetune.verify's arguments for the family's tiny model in `folder` with the batching given."""
    return [
        *DEBUG,
        f"model.name_or_path={folder}",
        "model.gguf_file=null",
        f"data.batching={batching}",
        *RECIPE_KEYS.get(family, []),
    ]


def family_folder(parent: Path, family: str, tokenizer) -> Path:
    """The family's tiny config (FAMILIES) and `tokenizer` (SmolLM2's) in a folder under `parent`, as a hub model's."""
    folder = parent / family
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    kwargs.update({k: len(tokenizer) if v is VOCAB else v for k, v in FAMILIES[family].items()})
    config = AutoConfig.for_model(family, **kwargs)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# recipe keys of the adapter cases (their rows: two_rank_batching's): LoRA on every linear layer (peft also wraps a
# mixture of experts' fused expert weights and its router), and the same over a 4-bit NF4 base (bitsandbytes
# quantizes the linear layers; fused expert weights stay in model.dtype)
LORA = ["model.lora.enabled=true", "model.lora.target_modules=all-linear"]
ADAPTERS = {"LoRA": LORA, "QLoRA": [*LORA, "model.quantization.bits=4"]}


def two_rank_batching(family: str) -> str:
    """The batching a family's two-rank case runs: packed rows where they are not refused, else padded."""
    return "padded" if (family, "packed") in REFUSED else "packed"


# (family, batching) → the pattern of the one error line that refuses it: layers that carry state along the sequence
# (finetune/model/sequence_mixers.py), or an attention whose packed rows cross sequences (the packed probe,
# finetune/model/packed_probe.py: gpt-oss builds its masks without the position_ids)
STATE = r"data\.batching=packed would carry the state of its .+ layers .* set data\.batching=token_budget"
CROSSING = (
    r"does not keep the sequences of a packed row apart: .*\(they attend to one another\); set "
    r"data\.batching=token_budget"
)
REFUSED = {
    **{(family, "packed"): STATE for family in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "bamba")},
    ("gpt_oss", "packed"): CROSSING,
}
