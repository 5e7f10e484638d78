"""`model.quantization`: a base loaded in 4-bit (QLoRA: NF4/FP4 blocks dequantized to the compute dtype in each
forward) or 8-bit (LLM.int8) by bitsandbytes, through transformers' own loading (`BitsAndBytesConfig` in
from_pretrained), then peft's k-bit preparation, then LoRA (required: the quantized weights cannot train).

A `model.from_config` model has no weights for from_pretrained to quantize: it is built as usual (seeded), saved into
a scratch folder and loaded from there quantized, so it quantizes by the very path a real checkpoint takes.
What k-bit preparation does and what the exactness claim is under a quantized base: docs/qlora.md.
"""

from __future__ import annotations

import shutil
import tempfile

import torch

from finetune import env
from finetune.recipe import ModelConfig, RecipeError

# model.dtype's names; model/loading.py and model/vlm.py load weights in them too
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a VLM's parts left in model.dtype unless model.quantization.llm_int8_skip_modules names its own list
VISION_PARTS = ["lm_head", "vision_tower", "multi_modal_projector", "visual", "vision_model"]


def is_quantized(cfg: ModelConfig) -> bool:
    return cfg.quantization.bits != "none"


def check_folder_quantization(cfg: ModelConfig, folder_method: str | None) -> None:
    """A quantized recipe against the model folder (`folder_method`: the quantization its config.json names, or
    None), before anything loads. The recipe's own keys: finetune/recipe/checks.py `check_quantization`."""
    if is_quantized(cfg) and folder_method is not None:
        raise RecipeError(
            f"model.quantization.bits={cfg.quantization.bits}: model.name_or_path={cfg.name_or_path} is already "
            f"quantized ({folder_method}); give its full-precision model (a GGUF is dequantized first), or set "
            "model.quantization.bits=none"
        )


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    """What a 4-bit layer dequantizes to and multiplies in: bnb_4bit_compute_dtype, auto: model.dtype."""
    name = cfg.quantization.bnb_4bit_compute_dtype
    return DTYPES[cfg.dtype if name == "auto" else name]


def bnb_config(cfg: ModelConfig, vision: bool):
    """transformers' BitsAndBytesConfig for the recipe's model.quantization (None: not quantized)."""
    from transformers import BitsAndBytesConfig

    q = cfg.quantization
    if q.bits == "none":
        return None
    skip = q.llm_int8_skip_modules
    if skip is None and vision:
        skip = VISION_PARTS
    if q.bits == "8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=q.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=compute_dtype(cfg),
        llm_int8_skip_modules=skip,
    )


def load_options(cfg: ModelConfig, vision: bool = False) -> dict:
    """from_pretrained's keyword arguments for a quantized base ({} for none): the BitsAndBytesConfig and the one
    device this rank trains on (bitsandbytes quantizes while loading onto it; the Trainer never moves the model)."""
    config = bnb_config(cfg, vision)
    if config is None:
        return {}
    device = f"cuda:{env.local_rank()}" if torch.cuda.is_available() else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


def quantize_built(model, cfg: ModelConfig, loader):
    """A model built from its config (model.from_config), quantized: saved into a scratch folder and loaded back by
    `loader(folder, **load_options)` (transformers' from_pretrained). The unquantized model is returned as is."""
    if not is_quantized(cfg):
        return model
    scratch = tempfile.mkdtemp(prefix="finetune-quantize-")
    source = model.config._name_or_path
    try:
        model.save_pretrained(scratch)
        del model
        quantized = loader(scratch, dtype=DTYPES[cfg.dtype], **load_options(cfg))
        # where it came from, not the scratch folder (peft writes it into adapter_config.json)
        quantized.config._name_or_path = quantized.name_or_path = source
        return quantized
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def quantized_layers(model) -> list[str]:
    """The names of the model's bitsandbytes-quantized linear layers."""
    import bitsandbytes as bnb

    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return [name for name, module in model.named_modules() if isinstance(module, kinds)]


def prepare_kbit(model, cfg: ModelConfig):
    """After a quantized load, before LoRA: check that the linear layers ARE quantized (nothing trains in full
    precision when 4-bit was asked), then peft's k-bit preparation without its gradient checkpointing (the recipe's
    train.gradient_checkpointing decides that): every base parameter frozen, every non-quantized fp16/bf16 parameter
    (norms, embeddings, the head) cast to float32."""
    if not is_quantized(cfg):
        return model
    from peft import prepare_model_for_kbit_training

    if not quantized_layers(model):
        raise RecipeError(
            f"model.quantization.bits={cfg.quantization.bits}: no linear layer of {cfg.name_or_path} was quantized; "
            "check model.quantization.llm_int8_skip_modules"
        )
    keep_trainable_layout(model)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def unquantized_experts_line(model, cfg: ModelConfig) -> str | None:
    """A quantized mixture of experts: its experts' fused weights (one 3-D tensor per layer and projection, not
    linear layers) are not quantized by bitsandbytes, and peft's k-bit preparation casts them to float32 with the
    norms; the start-up line says how much of the model that is, before its memory surprises anyone. None else."""
    if not is_quantized(cfg):
        return None
    frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
    experts = [p for name, p in frozen if p.dim() == 3 and ".experts." in name]
    if not experts:
        return None
    count = sum(p.numel() for p in experts)
    size = sum(p.numel() * p.element_size() for p in experts)
    return (
        f"note: model.quantization.bits={cfg.quantization.bits}: {count:,} parameters of the experts' fused weights "
        f"are not quantized (bitsandbytes quantizes linear layers; transformers keeps each layer's experts as 3-D "
        f"weights): {size / 2**30:.2f} GiB in {experts[0].dtype} after peft's k-bit preparation"
    )


def keep_trainable_layout(model) -> None:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights. On a CPU with AVX-512 BF16, a Linear4bit's first
    forward in eval mode without gradient (an evaluation, a sample, verify's or the planner's no-grad pass) rewrites
    its weight in place into an inference layout whose kernel (gemv_4bit) has no autograd: every later training
    forward gives the adapters below it a zero input gradient, and dequantize_4bit no longer reads the trained base.
    The layer keeps the layout it trains with instead: evaluation runs the same exact kernel as training."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def dequantize_base(model):
    """The model with every bitsandbytes 4-bit layer (inside peft's LoRA layers too) replaced, in place, by a plain
    Linear holding bitsandbytes' own dequantization of its weight (dequantize_4bit: the float weight each forward
    multiplies by): the model that trains, as plain floats, for finetune.verify's reference. Unquantized: as is."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "hf_quantizer", None) is None:
        return model
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    base.dequantize()
    for name, p in model.named_parameters():  # the new Linear weights are Parameters that would train
        p.requires_grad_(name in trained)
    return model
