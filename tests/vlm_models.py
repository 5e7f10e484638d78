"""A tiny LLaVA (SmolLM2's tokenizer, a 2-layer Llama, a 2-layer SigLIP tower) for the VLM tests; the fixtures that
build it once per module are in conftest.py."""

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

from finetune.model.llava import IMAGE_TOKEN, image_tokenizer, llava_processor
from finetune.model.vlm import prepare_vlm
from finetune.recipe import LoraConfig, ModelConfig
from tests.data_files import smollm2_folder


def tiny_processor():
    """A LLaVA processor of SmolLM2's tokenizer: 32 px images, 16 px patches (4 image tokens)."""
    tokenizer = image_tokenizer(AutoTokenizer.from_pretrained(str(smollm2_folder())))
    return llava_processor(tokenizer, image_size=32, patch_size=16)


def tiny_llava(processor, seed: int = 0, patch_size: int = 16) -> LlavaForConditionalGeneration:
    torch.manual_seed(seed)
    tokenizer = processor.tokenizer
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = SiglipVisionConfig(
        image_size=32,
        patch_size=patch_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        vision_use_head=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_seq_length=(32 // patch_size) ** 2,
    )
    config._attn_implementation = "sdpa"
    return LlavaForConditionalGeneration(config)


def prepared(processor, freeze=(), lora=False, seed=0):
    cfg = ModelConfig(name_or_path="tiny", freeze=list(freeze), lora=LoraConfig(enabled=lora))
    return prepare_vlm(tiny_llava(processor, seed), cfg, processor)


def save_tiny_vlm(processor, folder: Path) -> Path:
    """A tiny LLaVA and its processor saved together: what a hub VLM id resolves to."""
    tiny_llava(processor).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


class Recording:
    """Wraps a collator: the rows of every micro-batch and the batch it made, in the order they are consumed."""

    def __init__(self, inner):
        self.inner, self.batches, self.packed = inner, [], []

    def __call__(self, rows):
        self.batches.append([dict(r) for r in rows])
        batch = self.inner(rows)
        self.packed.append(batch)
        return batch
