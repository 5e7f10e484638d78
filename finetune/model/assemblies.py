"""Which VLM model.vision_config assembles from a text model (its model_type: a LLaVA by default,
finetune/model/llava.py, or a Qwen2.5-VL, finetune/model/qwen_vl.py), and the folder a VLM recipe loads from."""

from __future__ import annotations

from finetune.model import llava, qwen_vl
from finetune.recipe import ModelConfig, RecipeError


def assembly_kind(cfg: ModelConfig) -> str | None:
    """What model.vision_config assembles (its model_type: a LLaVA by default, or a Qwen2.5-VL); None: nothing."""
    kind = cfg.vision_config.get("model_type", llava.SIGLIP) if cfg.vision_config else None
    if kind not in (None, llava.SIGLIP, qwen_vl.MODEL_TYPE):
        choices = f"{llava.SIGLIP} (a LLaVA, the default) or {qwen_vl.MODEL_TYPE}"
        raise RecipeError(f"model.vision_config.model_type={kind}: one of {choices}")
    return kind


def assembled_config(cfg: ModelConfig):
    """A default config of the class model.vision_config assembles: enough for what depends on the class only."""
    from transformers import LlavaConfig, Qwen2_5_VLConfig

    return LlavaConfig() if assembly_kind(cfg) == llava.SIGLIP else Qwen2_5_VLConfig()


def vlm_folder(cfg: ModelConfig, folder: str) -> str:
    """The folder a VLM loads from: `folder` itself, or the model that model.vision_config assembles from it."""
    kind = assembly_kind(cfg)
    if kind is None:
        return folder
    return str((llava.assembled_folder if kind == llava.SIGLIP else qwen_vl.assembled_folder)(cfg, folder))
