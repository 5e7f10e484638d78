"""How a VLM's image rows reach its forward: what its forward takes beside them (the token types and rope positions
that finetune/data/image_inputs.py's collator part makes from this description; finetune/assemble.py joins the two),
and whether its rows pack exactly (a refusal naming the batching that works)."""

from __future__ import annotations

from finetune.recipe import ModelConfig, RecipeError, RunPlan


def image_text_class(config):
    """The transformers image-text model class of a config (None: not one transformers knows)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    try:
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    except KeyError:
        return None


def forward_inputs(config) -> dict:
    """The token types and rope positions this VLM's forward takes, as `ImageInputs`' fields: `mm_token_type_ids`
    and, for packed rows, the model's own get_rope_index bound to its config (the Qwen-VL family, GLM-4V); Gemma3's
    `token_type_ids` (its image tokens attend both ways in training only when it is given); {} for neither."""
    import inspect
    from types import SimpleNamespace

    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cls = image_text_class(config)
    forward = inspect.signature(cls.forward).parameters if cls is not None else {}
    ids = {name: getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")}
    image = ids["image_token_id"] if ids["image_token_id"] is not None else ids["image_token_index"]
    if "mm_token_type_ids" in forward:
        base = MODEL_MAPPING.get(type(config), None)
        rope_index = None
        if base is not None and hasattr(base, "get_rope_index"):  # it reads the config and one helper, no weights
            owner = SimpleNamespace(config=config)
            owner.get_vision_position_ids = base.get_vision_position_ids.__get__(owner)
            rope_index = base.get_rope_index.__get__(owner)
        types = {image: 1, **({ids["video_token_id"]: 2} if ids["video_token_id"] is not None else {})}
        return {"type_ids_key": "mm_token_type_ids", "type_of": types, "rope_index": rope_index}
    if "token_type_ids" in forward and getattr(config, "model_type", "") != "paligemma":
        return {"type_ids_key": "token_type_ids", "type_of": {image: 1}}
    return {}


def packing_refusal(config) -> str | None:
    """Why packed image rows would not be exact for this VLM class (None: they are: its image features fill the image
    tokens' embeddings, and its language model reads 1-D positions and a causal mask, as LLaVA's, or multimodal
    rope positions that the collator makes per sequence with the model's own get_rope_index)."""
    import inspect

    cls = image_text_class(config)
    if cls is None:
        return f"{type(config).__name__} is not a transformers image-text model whose positions and masks are known"
    forward = inspect.signature(cls.forward).parameters
    if "mm_token_type_ids" in forward and forward_inputs(config).get("rope_index") is None:
        return (
            "it computes its own rotary positions from each whole row and has no get_rope_index to give them per "
            "sequence"
        )
    if "token_type_ids" in forward:  # Gemma3: image blocks; PaliGemma: the prefix
        return (
            "part of each sequence attends both ways (token_type_ids), a mask no causal or varlen kernel takes "
            "without materializing it over the whole row"
        )
    return None


def check_packing(model: ModelConfig, plan: RunPlan, config) -> None:
    """Refuse packed image rows (training or evaluation) for a VLM that cannot pack them exactly."""
    asked = ["data.batching"] if plan.training.mode == "packed" else []
    if plan.evaluation is not None and plan.evaluation.mode == "packed":
        asked.append("eval.batching")
    why = packing_refusal(config) if asked else None
    if why:
        raise RecipeError(
            f"model.name_or_path={model.name_or_path}: {' and '.join(k + '=packed' for k in asked)} cannot pack "
            f"its image rows exactly: {why}; set {plan.instead_of_packing}"
        )
