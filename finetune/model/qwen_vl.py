"""A Qwen2.5-VL assembled once from a text model: with `model.vision_config: {model_type: qwen2_5_vl, …}` the
language model at `model.name_or_path` (a Llama such as SmolLM2, or a Qwen2) becomes the Qwen2 text model of a
`Qwen2_5_VLForConditionalGeneration` computing the same function on text, with a small vision tower and merger
built from the config (seeded init); its processor is a Qwen2.5-VL processor (image-only without torchvision:
finetune/model/processors.py) of the tokenizer + the four Qwen vision tokens. Built once into the cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from finetune.model.llava import add_token_rows, image_tokenizer
from finetune.model.loading import cached_folder
from finetune.model.processors import image_only, write_video_config
from finetune.recipe import ModelConfig, RecipeError

MODEL_TYPE = "qwen2_5_vl"
ASSEMBLY_VERSION = 2  # part of the cache key: bump when the assembly below changes
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
IMAGE_MARKER = VISION_START + IMAGE_PAD + VISION_END  # what an image part renders as (Qwen2.5-VL's own template)
TOKEN_IDS = {  # Qwen2_5_VLConfig's token-id fields: the added tokens' ids
    "image_token_id": IMAGE_PAD,
    "video_token_id": VIDEO_PAD,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}
# Every image is resized to a square of 2 × 2 merged patches: 4 image tokens (56 px at patch 14, merge 2), so the
# tiny recipe's rows stay short; set by min_pixels = max_pixels.
MERGED_SIDE = 2


def vision_fields(values: dict[str, Any]) -> dict[str, Any]:
    """model.vision_config's Qwen2_5_VLVisionConfig fields (model_type aside), each checked to be one."""
    from transformers import Qwen2_5_VLVisionConfig

    fields = {k: v for k, v in values.items() if k != "model_type"}
    default = Qwen2_5_VLVisionConfig()
    for key in fields:
        if not hasattr(default, key):
            raise RecipeError(f"model.vision_config.{key}: Qwen2_5_VLVisionConfig has no such field")
    if "out_hidden_size" in fields:
        raise RecipeError("model.vision_config.out_hidden_size: set by the assembly (the language model's hidden_size)")
    return fields


def vision_tower_config(values: dict[str, Any], text_hidden_size: int):
    """Qwen2_5_VLVisionConfig from model.vision_config; its output (the merger's) is the text model's width."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import Qwen2_5_VLVisionConfig

    try:
        config = Qwen2_5_VLVisionConfig(**vision_fields(values), out_hidden_size=text_hidden_size)
    except (TypeError, ValueError, StrictDataclassError) as e:  # the config's own checks (types, values)
        raise RecipeError(f"model.vision_config: {' '.join(str(e).split())}") from None
    if config.hidden_size % config.num_heads:
        raise RecipeError(
            f"model.vision_config: hidden_size={config.hidden_size} is not a multiple of num_heads={config.num_heads}"
        )
    return config


def assembled_folder(cfg: ModelConfig, lm_folder: str) -> Path:
    """The Qwen2.5-VL assembled from `lm_folder` and `model.vision_config`, built once in the cache."""
    vision_fields(cfg.vision_config)  # a misspelt key: one error before anything loads
    stamp = json.dumps(
        [MODEL_TYPE, ASSEMBLY_VERSION, str(lm_folder), dict(sorted(cfg.vision_config.items()))], default=str
    )

    def build(scratch: Path) -> None:
        print(f"assembling a Qwen2.5-VL (language model {lm_folder} + vision tower) once, in the cache", flush=True)
        model, processor = assemble(lm_folder, cfg.vision_config, cfg.trust_remote_code)
        model.save_pretrained(scratch)
        processor.save_pretrained(scratch)
        write_video_config(scratch, video_config(processor.image_processor))

    return cached_folder(f"qwen2_5_vl-{Path(str(lm_folder)).name}", stamp, build)


def video_config(image_processor) -> dict:
    """What AutoVideoProcessor reads to build Qwen2.5-VL's video processor (it needs torchvision; this is written
    without it): its class and the patch sizes it must share with the image processor."""
    keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean", "image_std")
    shared = {k: getattr(image_processor, k) for k in keys if getattr(image_processor, k, None) is not None}
    return {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor", **shared}


def assemble(lm_folder: str, vision_values: dict[str, Any], trust_remote_code: bool = False):
    """(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor): the pretrained language model, a seeded tower."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(lm_folder, trust_remote_code=trust_remote_code)
    tokenizer = image_tokenizer(tokenizer, (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD), IMAGE_MARKER)
    lm = AutoModelForCausalLM.from_pretrained(lm_folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    vision = vision_tower_config(vision_values, lm.config.hidden_size)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in TOKEN_IDS.items()}
    config = Qwen2_5_VLConfig(
        text_config=text_config(lm.config),
        vision_config=vision.to_dict(),
        tie_word_embeddings=lm.config.tie_word_embeddings,
        **ids,
    )
    with torch.random.fork_rng():  # the same tower and merger whatever the recipe's seed
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration(config)
    load_language_model(model, lm)
    add_token_rows(model, lm.config.vocab_size, len(tokenizer))
    model.generation_config = lm.generation_config
    return model, qwen_processor(tokenizer, vision)


def text_config(source) -> dict[str, Any]:
    """Qwen2_5_VLTextConfig fields computing the source model's function: its sizes, norms and RoPE base; mrope's
    three sections (time, height, width) split the rotary frequencies as Qwen2.5-VL does (1 : 3 : 3 of 64 at
    head_dim 128), and with the equal t/h/w positions of text mrope is plain RoPE."""
    head_dim = source.hidden_size // source.num_attention_heads
    rope = dict(getattr(source, "rope_parameters", None) or {})
    refused = {
        "head_dim": getattr(source, "head_dim", head_dim) != head_dim,
        "rope_parameters.rope_type": rope.get("rope_type", "default") != "default",
        "attention_bias": bool(getattr(source, "attention_bias", False)),
        "mlp_bias": bool(getattr(source, "mlp_bias", False)),
    }
    if any(refused.values()):
        raise RecipeError(
            f"model.name_or_path: a {source.model_type} with {', '.join(k for k, v in refused.items() if v)} "
            "unlike Qwen2's (head_dim = hidden_size / heads, default RoPE, no MLP/output biases) cannot become "
            "Qwen2.5-VL's language model"
        )
    half = head_dim // 2
    time = half // 4
    sections = [time, (half - time) // 2, half - time - (half - time) // 2]
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        hidden_act=source.hidden_act,
        max_position_embeddings=source.max_position_embeddings,
        rms_norm_eps=source.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"], "mrope_section": sections},
        tie_word_embeddings=source.tie_word_embeddings,
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
        pad_token_id=source.pad_token_id,
    )


def load_language_model(model, lm) -> None:
    """The source decoder's weights into the Qwen2 text model (the same names); its q/k/v biases, which a Llama
    lacks, are zero so that it computes the Llama's function."""
    target = model.model.language_model
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.zero_()
    result = target.load_state_dict(lm.get_decoder().state_dict(), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    if missing or result.unexpected_keys:
        raise RecipeError(
            f"model.name_or_path: its decoder's weights do not match Qwen2's (missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]})"
        )
    model.lm_head.load_state_dict(lm.get_output_embeddings().state_dict())


def qwen_processor(tokenizer, vision):
    """A Qwen2.5-VL processor of the tokenizer (image-only: no video processor): images resized in PIL to
    MERGED_SIDE × MERGED_SIDE merged patches."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    side = MERGED_SIDE * vision.patch_size * vision.spatial_merge_size
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=side * side,
        max_pixels=side * side,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
    )
    return image_only(Qwen2_5_VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
