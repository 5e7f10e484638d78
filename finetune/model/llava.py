"""A LLaVA assembled once from a text model: with `model.vision_config`, the language model at `model.name_or_path`
(e.g. the SmolLM2 GGUF) becomes that of a `LlavaForConditionalGeneration` with a SigLIP tower and projector built
from the config (seeded init), and a processor of its tokenizer + an `<image>` token + a PIL SigLIP image processor
(no torchvision); assembled once into the cache (finetune.env.cache_dir).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from finetune.model.loading import cached_folder
from finetune.recipe import ModelConfig, RecipeError

IMAGE_TOKEN = "<image>"
ASSEMBLY_VERSION = 1  # part of the cache key: bump when the assembly below changes
SIGLIP = "siglip_vision_model"  # model.vision_config.model_type of this assembly (the default)


def content_parts_to_text(marker: str) -> str:
    """A chat-template prefix: messages whose content is a list of parts ({"type": "image"} / {"type": "text", …})
    become the plain strings a text model's template expects, an image part becoming `marker`; strings pass as they
    are."""
    return (
        "{%- set ns = namespace(messages=[]) -%}{%- for m in messages -%}{%- if m['content'] is string -%}"
        "{%- set ns.messages = ns.messages + [m] -%}{%- else -%}{%- set text = namespace(value='') -%}"
        "{%- for part in m['content'] -%}{%- if part['type'] == 'image' -%}{%- set text.value = text.value + '"
        + marker
        + "' -%}{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}"
        "{%- endif -%}{%- endfor -%}"
        "{%- set ns.messages = ns.messages + [{'role': m['role'], 'content': text.value}] -%}"
        "{%- endif -%}{%- endfor -%}{%- set messages = ns.messages -%}"
    )


def vision_tower_config(values: dict[str, Any]):
    from transformers import SiglipVisionConfig

    config = SiglipVisionConfig(vision_use_head=False)  # LLaVA reads the patch features; a pooling head is unused
    for key, value in values.items():
        if key == "model_type":  # SIGLIP: vlm_folder routed here by it
            continue
        if not hasattr(config, key):
            raise RecipeError(f"model.vision_config.{key}: SiglipVisionConfig has no such field")
        setattr(config, key, value)
    if config.image_size % config.patch_size:
        raise RecipeError(
            f"model.vision_config: image_size={config.image_size} is not a multiple of patch_size={config.patch_size}"
        )
    return config


def assembled_folder(cfg: ModelConfig, lm_folder: str) -> Path:
    """The LLaVA assembled from `lm_folder` and `model.vision_config`, built once in the cache (file lock, rename)."""
    stamp = json.dumps([ASSEMBLY_VERSION, str(lm_folder), dict(sorted(cfg.vision_config.items()))], default=str)

    def build(scratch: Path) -> None:
        print(f"assembling a LLaVA (language model {lm_folder} + SigLIP tower) once, in the cache", flush=True)
        model, processor = assemble(lm_folder, vision_tower_config(cfg.vision_config), cfg.trust_remote_code)
        model.save_pretrained(scratch)
        processor.save_pretrained(scratch)

    return cached_folder(f"llava-{Path(str(lm_folder)).name}", stamp, build)


def assemble(lm_folder: str, vision, trust_remote_code: bool = False):
    """(LlavaForConditionalGeneration, LlavaProcessor): the pretrained language model, a seeded new tower, projector."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = image_tokenizer(AutoTokenizer.from_pretrained(lm_folder, trust_remote_code=trust_remote_code))
    lm = AutoModelForCausalLM.from_pretrained(lm_folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    patches = (vision.image_size // vision.patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision,
        text_config=lm.config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_seq_length=patches,
        tie_word_embeddings=lm.config.tie_word_embeddings,
    )
    with torch.random.fork_rng():  # the same tower and projector whatever the recipe's seed
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.get_decoder().state_dict())
    model.lm_head.load_state_dict(lm.get_output_embeddings().state_dict())
    add_token_rows(model, lm.config.vocab_size, len(tokenizer))
    model.generation_config = lm.generation_config
    return model, llava_processor(tokenizer, vision.image_size, vision.patch_size)


def add_token_rows(model, old_vocab: int, vocab: int) -> None:
    """Grow the embeddings (and an untied output head) to `vocab` rows; the new rows (image tokens, only ever input
    placeholders) are the mean embedding."""
    model.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        for matrix in {id(m): m for m in (model.get_input_embeddings().weight, model.lm_head.weight)}.values():
            matrix[old_vocab:] = matrix[:old_vocab].mean(0)


def llava_processor(tokenizer, image_size: int, patch_size: int):
    """A LlavaProcessor for a tokenizer that has the image token: SigLIP preprocessing in PIL (no torchvision)."""
    from transformers import LlavaProcessor, SiglipImageProcessorPil

    image_processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="full",
        chat_template=tokenizer.chat_template,
        image_token=IMAGE_TOKEN,
    )


def image_tokenizer(tokenizer, tokens: tuple[str, ...] = (IMAGE_TOKEN,), marker: str = IMAGE_TOKEN):
    """A text model's tokenizer with the image `tokens`, and a chat template that renders image parts as `marker`."""
    new = [t for t in tokens if t not in tokenizer.get_vocab()]
    if new:
        tokenizer.add_special_tokens({"additional_special_tokens": new})
    if tokenizer.chat_template is None:
        raise RecipeError(f"model.name_or_path: {tokenizer.name_or_path} has no chat template to render images in")
    prefix = content_parts_to_text(marker)
    if not tokenizer.chat_template.startswith(prefix):
        tokenizer.chat_template = prefix + tokenizer.chat_template
    return tokenizer
