"""Vision-language models: load a VLM and its processor, freeze, LoRA on the language model only, a tower that runs
on every micro-batch.

With `model.vision_config`, the language model at `model.name_or_path` (e.g. the SmolLM2 GGUF) becomes that of a
`LlavaForConditionalGeneration` with a SigLIP tower and projector built from the config (seeded init), and a processor
of its tokenizer + an `<image>` token + a PIL SigLIP image processor (no torchvision); assembled once into
FINETUNE_CACHE. Then, as for a hub VLM id or folder, AutoProcessor and AutoModelForImageTextToText load it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from finetune.recipe import Config, ModelConfig, RecipeError
from finetune.models import DTYPES, cached_folder, freeze
from finetune.env import is_main_process

IMAGE_TOKEN = "<image>"
ASSEMBLY_VERSION = 1  # part of the cache key: bump when the assembly below changes
SHAPES = "shapes_captions"
# Messages whose content is a list of parts ({"type": "image"} / {"type": "text", "text": …}) become the plain strings
# a text model's chat template expects, an image part becoming the image token; string contents pass unchanged.
CONTENT_PARTS_TO_TEXT = (
    "{%- set ns = namespace(messages=[]) -%}{%- for m in messages -%}{%- if m['content'] is string -%}"
    "{%- set ns.messages = ns.messages + [m] -%}{%- else -%}{%- set text = namespace(value='') -%}"
    "{%- for part in m['content'] -%}{%- if part['type'] == 'image' -%}{%- set text.value = text.value + '"
    + IMAGE_TOKEN + "' -%}{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}"
    "{%- endif -%}{%- endfor -%}{%- set ns.messages = ns.messages + [{'role': m['role'], 'content': text.value}] -%}"
    "{%- endif -%}{%- endfor -%}{%- set messages = ns.messages -%}"
)


def is_vlm(cfg: Config, folder: str) -> bool:
    """A recipe trains a VLM when it assembles one (model.vision_config) or its model's config has a vision part."""
    vision = bool(cfg.model.vision_config)
    if not vision:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError):  # models.load_model reports an unloadable model
            config = None
        vision = getattr(config, "vision_config", None) is not None
    if vision and getattr(cfg.data, "streaming", False):
        raise RecipeError("data.streaming=true reads text rows only; a VLM recipe needs data.streaming=false")
    if not vision and cfg.data.source == SHAPES:
        raise RecipeError(
            f"data.source={SHAPES} is an image set and model.name_or_path={cfg.model.name_or_path} is a text model; "
            "set model.vision_config (see recipes/vlm.yaml) or use a vision-language model"
        )
    return vision


# ---- assembling a LLaVA once ----


def vision_tower_config(values: dict[str, Any]):
    from transformers import SiglipVisionConfig

    config = SiglipVisionConfig(vision_use_head=False)  # LLaVA reads the patch features; a pooling head is unused
    for key, value in values.items():
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
        vision_config=vision, text_config=lm.config, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="full", vision_feature_layer=-1, image_seq_length=patches,
        tie_word_embeddings=lm.config.tie_word_embeddings,
    )
    with torch.random.fork_rng():  # the same tower and projector whatever the recipe's seed
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.get_decoder().state_dict())
    model.lm_head.load_state_dict(lm.get_output_embeddings().state_dict())
    old_vocab = lm.config.vocab_size
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # new rows (the image token, only ever an input placeholder): the mean embedding
        for matrix in {id(m): m for m in (model.get_input_embeddings().weight, model.lm_head.weight)}.values():
            matrix[old_vocab:] = matrix[:old_vocab].mean(0)
    model.generation_config = lm.generation_config
    return model, llava_processor(tokenizer, vision.image_size, vision.patch_size)


def llava_processor(tokenizer, image_size: int, patch_size: int):
    """A LlavaProcessor for a tokenizer that has the image token: SigLIP preprocessing in PIL (no torchvision)."""
    from transformers import LlavaProcessor, SiglipImageProcessorPil

    image_processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
        vision_feature_select_strategy="full", chat_template=tokenizer.chat_template, image_token=IMAGE_TOKEN,
    )


def image_tokenizer(tokenizer):
    """A text model's tokenizer with the image token, and a chat template that renders image parts as that token."""
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    if tokenizer.chat_template is None:
        raise RecipeError(f"model.name_or_path: {tokenizer.name_or_path} has no chat template to render images in")
    if not tokenizer.chat_template.startswith(CONTENT_PARTS_TO_TEXT):
        tokenizer.chat_template = CONTENT_PARTS_TO_TEXT + tokenizer.chat_template
    return tokenizer


def vlm_folder(cfg: ModelConfig, folder: str) -> str:
    return str(assembled_folder(cfg, folder)) if cfg.vision_config else folder


# ---- loading ----


def load_processor(cfg: ModelConfig, folder: str):
    from transformers import AutoProcessor

    source = vlm_folder(cfg, folder)
    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise RecipeError(f"model.name_or_path={cfg.name_or_path}: no processor ({str(e).splitlines()[0]})") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise RecipeError(f"model.name_or_path={cfg.name_or_path}: {type(processor).__name__} is not an image+text "
                          "processor")
    if processor.tokenizer.pad_token is None:  # padding is masked from attention and loss; any id will do
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def load_vlm(cfg: ModelConfig, folder: str, processor):
    from transformers import AutoModelForImageTextToText

    if cfg.from_config or cfg.config_overrides:
        raise RecipeError("model.from_config/config_overrides are for text models; a VLM recipe sizes its vision "
                          "tower with model.vision_config")
    source = vlm_folder(cfg, folder)
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            source, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )
    except (OSError, ValueError) as e:
        raise RecipeError(f"model.name_or_path={cfg.name_or_path}: cannot load as an image+text model "
                          f"({str(e).splitlines()[0]})") from None
    return prepare_vlm(model, cfg, processor)


def prepare_vlm(model, cfg: ModelConfig, processor):
    """Checks, freezing and LoRA for training any VLM, in this order (freeze decides what LoRA keeps training)."""
    dummy = dummy_image_inputs(processor)
    check_image_tokens(model, processor, dummy)
    freeze(model, cfg.freeze)
    freeze_unused_vision_parameters(model, dummy)
    run_vision_on_every_batch(model, dummy)
    return add_language_lora(model, cfg) if cfg.lora.enabled else model


def black_image(processor):
    from PIL import Image

    size = getattr(processor.image_processor, "size", None) or {}
    side = size.get("height") or size.get("shortest_edge") or 224
    return Image.new("RGB", (side, side))


def dummy_image_inputs(processor) -> dict[str, torch.Tensor]:
    """The image processor's tensors for one black image (what get_image_features takes, e.g. pixel_values)."""
    out = processor.image_processor([black_image(processor)], return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def image_features(model, dummy: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The projected features of the dummy image(s), as [tokens, hidden] tensors."""
    param = next(model.parameters())
    inputs = {k: v.to(param.device, param.dtype if v.is_floating_point() else v.dtype) for k, v in dummy.items()}
    out = model.get_image_features(**inputs)
    out = getattr(out, "pooler_output", out)
    tensors = list(out) if isinstance(out, (list, tuple)) else [out]
    return [t.reshape(-1, t.shape[-1]) for t in tensors]


def check_image_tokens(model, processor, dummy) -> None:
    """Placeholders per image (processor) must equal features per image (model): a clear error now, not a shape
    trace at the first batch."""
    image_token = getattr(processor, "image_token", IMAGE_TOKEN)
    ids = processor(text=[image_token], images=[black_image(processor)], return_tensors="pt")["input_ids"]
    token_id = getattr(model.config, "image_token_id", None) or getattr(model.config, "image_token_index", None)
    placeholders = int((ids == token_id).sum())
    with torch.no_grad():
        features = sum(t.shape[0] for t in image_features(model, dummy))
    if placeholders != features:
        raise RecipeError(
            f"model.name_or_path={model.name_or_path}: the processor expands one image into {placeholders} "
            f"'{image_token}' tokens but the vision tower gives {features} features per image; the processor does not "
            "belong to this model (image size, patch size or feature strategy differ): save them together"
        )


def vision_parameters(model) -> dict[str, torch.nn.Parameter]:
    """Parameters outside the language model and its embeddings: the vision tower and the projector."""
    language = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) not in language}


def freeze_unused_vision_parameters(model, dummy) -> None:
    """Freeze vision parameters the image features never use (e.g. SigLIP's post-layernorm: LLaVA reads the hidden
    states before it); DDP without find_unused_parameters would wait for their gradients forever."""
    trainable = {n: p for n, p in vision_parameters(model).items() if p.requires_grad}
    if not trainable:
        return
    torch.stack([f.sum() for f in image_features(model, dummy)]).sum().backward()
    unused = [n for n, p in trainable.items() if p.grad is None]
    for p in model.parameters():
        p.grad = None
    for name in unused:
        trainable[name].requires_grad_(False)
    if unused and is_main_process():
        print(f"frozen {len(unused)} vision parameters the image features do not use: {', '.join(unused[:4])}"
              f"{', …' if len(unused) > 4 else ''}", flush=True)


def run_vision_on_every_batch(model, dummy) -> None:
    """A training micro-batch without images still runs the vision tower, on a black image whose features enter the
    logits times zero: the loss and every gradient are unchanged (a zero gradient for the tower), but every rank runs
    the same collectives (FSDP gathers the tower's shards) and every trainable parameter gets a gradient (DDP)."""
    model._finetune_dummy_image = dummy
    model.register_forward_pre_hook(_dummy_image_features, with_kwargs=True)
    model.register_forward_hook(_add_zero_weighted, with_kwargs=True, always_call=True)


def _dummy_image_features(module, args, kwargs):
    dummy = module._finetune_dummy_image
    if module.training and torch.is_grad_enabled() and all(kwargs.get(k) is None for k in dummy):
        module._finetune_dummy_sum = torch.stack([f.sum() for f in image_features(module, dummy)]).sum()


def _add_zero_weighted(module, args, kwargs, output):
    total = module.__dict__.pop("_finetune_dummy_sum", None)
    if total is not None and output is not None and getattr(output, "logits", None) is not None:
        output.logits = output.logits + 0.0 * total.to(output.logits.dtype)
    return output


# ---- LoRA on the language model only ----


def add_language_lora(model, cfg: ModelConfig):
    """LoRA on `model.lora.target_modules` inside the language model only (a SigLIP tower has q_proj/v_proj too).
    Whatever else is trainable after model.freeze (e.g. the projector) keeps training fully (peft modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    decoder = model.get_decoder()
    language = next(n for n, m in model.named_modules() if m is decoder)
    keep = fully_trainable_modules(model, skip={id(decoder), id(model.get_output_embeddings())})
    lora = LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, task_type="CAUSAL_LM",
        target_modules=rf"{re.escape(language)}\..*\.(?:{'|'.join(map(re.escape, cfg.lora.target_modules))})",
        modules_to_save=keep or None,
    )
    return get_peft_model(model, lora)


def fully_trainable_modules(module, skip: set[int], prefix: str = "") -> list[str]:
    """The outermost submodules (not in `skip`) whose parameters all train: what LoRA must keep training fully."""
    found = []
    for name, child in module.named_children():
        if id(child) in skip:
            continue
        flags = [p.requires_grad for p in child.parameters()]
        full = f"{prefix}{name}"
        if flags and all(flags):
            found.append(full)
        elif any(flags):
            found += fully_trainable_modules(child, skip, full + ".")
    return found
