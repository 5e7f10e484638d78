"""Vision-language models: whether a recipe trains one, load it and its processor, freeze, LoRA on the language model
only, a tower that runs on every micro-batch.

With `model.vision_config` the VLM is first assembled once from a text model (finetune/model/llava.py, qwen_vl.py);
then, as for a hub VLM id or folder, AutoProcessor (image-only without torchvision: processors.py) and
AutoModelForImageTextToText load it.
"""

from __future__ import annotations

import math
import re
import threading

import torch

from finetune.env import is_main_process
from finetune.model.assemblies import assembled_config, vlm_folder
from finetune.model.freeze import freeze
from finetune.model.image_rows import check_packing, forward_inputs
from finetune.model.llava import IMAGE_TOKEN
from finetune.model.loading import attention_asked
from finetune.model.processors import auto_processor
from finetune.model.quantized import DTYPES, load_options, prepare_kbit
from finetune.recipe import DataConfig, ModelConfig, RecipeError, RunPlan, first_line

SHAPES = "shapes_captions"


def is_vlm(model: ModelConfig, data: DataConfig, plan: RunPlan, folder: str) -> bool:
    """A recipe trains a VLM when it assembles one (model.vision_config) or its model's config has a vision part."""
    config = None
    if not model.vision_config:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError):  # finetune.model.loading.load_model reports an unloadable model
            config = None
    vision = bool(model.vision_config) or getattr(config, "vision_config", None) is not None
    if vision and data.streaming:
        raise RecipeError("data.streaming=true reads text rows only; a VLM recipe needs data.streaming=false")
    if not vision and data.source == SHAPES:
        raise RecipeError(
            f"data.source={SHAPES} is an image set and model.name_or_path={model.name_or_path} is a text model; "
            "set model.vision_config (see recipes/vlm.yaml) or use a vision-language model"
        )
    if model.vision_config:  # an assembled VLM: packing depends on its class only
        config = assembled_config(model)
    if vision and config is not None:
        check_packing(model, plan, config)
    return vision


def forward_image_inputs(cfg: ModelConfig, folder: str) -> dict:
    """What this VLM's forward takes beside the token ids and pixels (token types, packed rows' rope positions), as
    finetune/data/image_inputs.py's `ImageInputs` fields."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vlm_folder(cfg, folder), trust_remote_code=cfg.trust_remote_code)
    return forward_inputs(config)


# ---- loading ----


def load_processor(cfg: ModelConfig, folder: str):
    source = vlm_folder(cfg, folder)
    try:  # AutoProcessor, or image-only where only a video processor needs torchvision (Qwen-VL)
        processor = auto_processor(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise RecipeError(f"model.name_or_path={cfg.name_or_path}: no processor ({first_line(e)})") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise RecipeError(
            f"model.name_or_path={cfg.name_or_path}: {type(processor).__name__} is not an image+text processor"
        )
    if processor.tokenizer.pad_token is None:  # padding is masked from attention and loss; any id will do
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def load_vlm(cfg: ModelConfig, folder: str, processor):
    from transformers import AutoModelForImageTextToText

    if cfg.from_config or cfg.config_overrides:
        raise RecipeError(
            "model.from_config/config_overrides are for text models; a VLM recipe sizes its vision "
            "tower with model.vision_config"
        )
    source = vlm_folder(cfg, folder)
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            source,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=attention_asked(cfg),
            trust_remote_code=cfg.trust_remote_code,
            **load_options(cfg, vision=True),
        )
    except (OSError, ValueError) as e:
        raise RecipeError(
            f"model.name_or_path={cfg.name_or_path}: cannot load as an image+text model ({first_line(e)})"
        ) from None
    return prepare_vlm(prepare_kbit(model, cfg), cfg, processor)


def prepare_vlm(model, cfg: ModelConfig, processor):
    """Checks, freezing and LoRA for training any VLM, in this order (freeze decides what LoRA keeps training)."""
    dummy = dummy_image_inputs(processor)
    check_image_tokens(model, processor, dummy)
    freeze(model, cfg.freeze)
    freeze_unused_vision_parameters(model, dummy)
    run_vision_on_every_batch(model, dummy)
    return add_language_lora(model, cfg) if cfg.lora.enabled else model


def black_image(processor):
    """The smallest square image the processor keeps as it is (the dummy image runs on every image-less batch)."""
    from PIL import Image

    image_processor = processor.image_processor
    size = getattr(image_processor, "size", None) or {}
    side = size.get("height") or size.get("shortest_edge") or 224
    if getattr(image_processor, "merge_size", None):  # Qwen-VL, GLM-4V: shortest_edge is an area (min_pixels)
        side = math.isqrt(side - 1) + 1
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
        print(
            f"frozen {len(unused)} vision parameters the image features do not use: {', '.join(unused[:4])}"
            f"{', …' if len(unused) > 4 else ''}",
            flush=True,
        )


def run_vision_on_every_batch(model, dummy) -> None:
    """A training micro-batch without images still runs the vision tower, on a black image whose features enter the
    logits times zero: the loss and every gradient are unchanged (a zero gradient for the tower), but every rank runs
    the same collectives (FSDP gathers the tower's shards) and every trainable parameter gets a gradient (DDP)."""
    hooks = DummyImageFeatures(dummy)
    model.register_forward_pre_hook(hooks.before, with_kwargs=True)
    model.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)


class DummyImageFeatures:
    """The model's forward hooks for `run_vision_on_every_batch`: the dummy image inputs, and the sum of their features
    from a forward's start to its end."""

    def __init__(self, dummy: dict):
        self.dummy = dummy
        self.pending: dict[int, torch.Tensor] = {}  # per thread: DataParallel runs replicas in threads

    def before(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled() and all(kwargs.get(k) is None for k in self.dummy):
            features = image_features(module, self.dummy)
            self.pending[threading.get_ident()] = torch.stack([f.sum() for f in features]).sum()

    def after(self, module, args, kwargs, output):
        total = self.pending.pop(threading.get_ident(), None)
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
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        task_type="CAUSAL_LM",
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
