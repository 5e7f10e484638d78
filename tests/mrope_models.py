"""Tiny multimodal-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V) and packed image rows for them, shared by
tests/test_vlm_mrope_packed.py and its two-rank worker."""

import io

import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from finetune.data.images import open_image
from finetune.testing.toy import VOCAB, tiny_qwen_vl

IMAGE, VIDEO, START, END = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
SIZES = {"square": (56, 56), "wide": (112, 56)}  # 14 px patches merged 2×2: 4 and 8 image tokens


def image_processor():
    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 112, patch_size=14, merge_size=2)


def tiny(family: str):
    """A tiny model of `family` whose vision tokens are IMAGE, VIDEO, START, END."""
    if family == "qwen2_5_vl":
        return tiny_qwen_vl()
    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 1, 1]}
        vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, attn_implementation="sdpa", **tokens)
        return Qwen2VLForConditionalGeneration(config)
    if family == "glm4v":
        from transformers import Glm4vConfig, Glm4vForConditionalGeneration

        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 1, 1], "partial_rotary_factor": 1.0}
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, image_size=56)
        glm_tokens = dict(
            image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END
        )
        config = Glm4vConfig(text_config=text, vision_config=vision, attn_implementation="sdpa", **glm_tokens)
        return Glm4vForConditionalGeneration(config)
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text.update(
        head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    )
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=14,
        num_position_embeddings=64,
        deepstack_visual_indexes=[1],
    )
    config = Qwen3VLConfig(text_config=text, vision_config=vision, attn_implementation="sdpa", **tokens)
    return Qwen3VLForConditionalGeneration(config)


def png(size: tuple[int, int], seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def row(name: str, sizes: list[str], seed: int) -> dict:
    """A sequence: prompt text, each image as START + its image tokens + END, an answer that is trained on."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, VOCAB - 5, (n,), generator=g).tolist()  # noqa: E731
    ids, labels = words(3), [-100] * 3
    for size in sizes:
        w, h = SIZES[size]
        tokens = (w // 28) * (h // 28)
        ids += [START] + [IMAGE] * tokens + [END] + words(2)
        labels += [-100] * (tokens + 4)
    answer = words(4 + seed % 3)
    ids, labels = ids + answer, labels + [-100] + answer[1:]
    images = [{"bytes": png(SIZES[s], seed * 10 + k), "path": None} for k, s in enumerate(sizes)]
    return {"input_ids": ids, "labels": labels, "images": images, "row": name, "length": len(ids)}


ROWS = [  # 3 rows per packed row, 2 packed rows per window: several images per sequence and per packed row
    row("two images", ["square", "wide"], 1),
    row("text only", [], 2),
    row("one wide", ["wide"], 3),
    row("one square", ["square"], 4),
    row("three images", ["wide", "square", "square"], 5),
    row("text again", [], 6),
]


def alone(model, seq: dict, processor) -> dict:
    """One sequence's inputs as a user would give them: the model computes its own positions from the token types."""
    ids = torch.tensor([seq["input_ids"]])
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE).long()}
    if seq["images"]:
        pixels = processor([open_image(i["bytes"]) for i in seq["images"]], return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"].to(model.dtype), image_grid_thw=pixels["image_grid_thw"])
    return inputs
