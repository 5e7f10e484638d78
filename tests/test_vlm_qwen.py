"""A Qwen2.5-VL assembled from a text model (model.vision_config.model_type=qwen2_5_vl): on text rows it computes the
source Llama's logits; its image-only processor (no torchvision) expands an image into as many <|image_pad|> tokens
as the tower gives features; the cached folder reloads; recipes/vlm_qwen.yaml's keys; misspelt keys are one error."""

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from finetune.model import qwen_vl
from finetune.model.freeze import matches_prefix
from finetune.model.image_rows import packing_refusal
from finetune.model.vlm import is_vlm, load_processor, prepare_vlm, vision_parameters
from finetune.recipe import ModelConfig, RecipeError, load_config, resolve_plan
from finetune.training.optim import param_groups
from tests.data_files import smollm2_folder

VISION = {
    "model_type": "qwen2_5_vl",
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
}
TOWER = ["model.visual.patch_embed", "model.visual.blocks"]  # recipes/vlm_qwen.yaml's model.freeze
TEXT = "The quick brown fox jumps over the lazy dog, and then it sleeps under the old oak tree."


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny Llama with SmolLM2's tokenizer (head_dim 16, an untrivial RoPE base), saved as a text model folder."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500.0,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def assembled(llama_folder):
    return qwen_vl.assemble(str(llama_folder), VISION)


def image_row(processor, colour: str = "red"):
    text = f"What is this? {qwen_vl.IMAGE_MARKER} A shape."
    return processor(text=[text], images=[Image.new("RGB", (64, 64), colour)], return_tensors="pt")


def test_on_text_rows_the_assembled_model_computes_the_source_llamas_logits(llama_folder, assembled):
    model, processor = assembled
    llama = LlamaForCausalLM.from_pretrained(llama_folder, dtype=torch.float32).eval()
    ids = processor.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 16  # positions far enough apart for a wrong rotary split to show
    with torch.no_grad():
        want = llama(input_ids=ids).logits
        got = model.eval()(input_ids=ids).logits
    vocab = want.shape[-1]
    assert got.shape[-1] == vocab + 4  # the four Qwen vision tokens
    assert (got[..., :vocab] - want).abs().max() <= 1e-5 * want.abs().max()
    text = model.config.text_config
    assert sum(text.rope_parameters["mrope_section"]) == 64 // 4 // 2 and text.rope_parameters["rope_theta"] == 500.0
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as in the source


def test_the_image_only_processor_gives_as_many_image_pads_as_the_tower_gives_features(assembled):
    model, processor = assembled
    assert not hasattr(processor, "video_processor") and type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    out = image_row(processor)
    grid = out["image_grid_thw"][0]
    pads = int((out["input_ids"] == model.config.image_token_id).sum())
    assert grid.tolist() == [1, 4, 4] and pads == int(grid.prod()) // 2**2 == 4
    assert out["mm_token_type_ids"].sum() == pads and out["pixel_values"].shape[0] == int(grid.prod())
    with torch.no_grad():
        features = model.model.get_image_features(out["pixel_values"], out["image_grid_thw"]).pooler_output
    assert [f.shape for f in features] == [(pads, model.config.text_config.hidden_size)]
    # prepare_vlm's check_image_tokens (processor vs tower) passes, and the image reaches the logits
    prepared = prepare_vlm(model, ModelConfig(name_or_path="tiny", freeze=TOWER), processor).eval()
    with torch.no_grad():
        red, blue = (prepared(**image_row(processor, c)).logits for c in ("red", "blue"))
    assert torch.isfinite(red).all() and not torch.allclose(red, blue)


def test_the_tower_freezes_and_the_merger_trains_at_its_lr_multiplier(llama_folder):
    model, processor = qwen_vl.assemble(str(llama_folder), VISION)
    prepare_vlm(model, ModelConfig(name_or_path="tiny", freeze=TOWER), processor)
    trainable = sorted(n for n, p in vision_parameters(model).items() if p.requires_grad)
    assert trainable and all(n.startswith("model.visual.merger.") for n in trainable)
    assert all(p.requires_grad for p in model.model.visual.merger.parameters())
    cfg = load_config(["recipe=recipes/vlm_qwen.yaml"])
    groups = param_groups(model, cfg.optim, 1e-3)
    merger = {n for g in groups if g["lr"] == pytest.approx(1e-2) for n in g["names"]}
    assert merger == {n for n in trainable if matches_prefix(n, "model.visual.merger")}


def test_the_cache_folder_reloads_with_auto_model_and_load_processor(
    llama_folder, assembled, monkeypatch, capsys, tmp_path
):
    monkeypatch.setenv("FINETUNE_CACHE", str(llama_folder.parent / "cache"))
    cfg = ModelConfig(name_or_path="tiny-llama", vision_config=VISION)
    processor = load_processor(cfg, str(llama_folder))
    folder = qwen_vl.assembled_folder(cfg, str(llama_folder))  # built once: the second call finds it
    printed = capsys.readouterr().out
    assert printed.count("assembling a Qwen2.5-VL") == 1
    assert "Qwen2_5_VLProcessor: images only, videos unavailable (torchvision is not installed)" in printed
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    row = image_row(processor)
    assert torch.equal(row["input_ids"], image_row(assembled[1])["input_ids"])
    with torch.no_grad():  # the same weights as assembled in memory (seeded tower) and the same chat template
        assert torch.allclose(model(**row).logits, assembled[0].eval()(**row).logits, atol=1e-6)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    assert f"<|im_start|>user\n{qwen_vl.IMAGE_MARKER}Count.<|im_end|>" in rendered
    # the video processor's config travels with every save, so AutoProcessor loads a saved folder where torchvision
    # is installed (it is not here): its class and the patch sizes it shares with the image processor
    video = json.loads((folder / "video_preprocessor_config.json").read_text())
    image = processor.image_processor
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor"
    assert (video["patch_size"], video["merge_size"], video["temporal_patch_size"]) == (
        image.patch_size,
        image.merge_size,
        image.temporal_patch_size,
    )
    processor.save_pretrained(tmp_path / "output")
    assert json.loads((tmp_path / "output" / "video_preprocessor_config.json").read_text()) == video


@pytest.mark.parametrize(
    "vision, key",
    [
        ({**VISION, "model_type": "qwen9_vl"}, "model.vision_config.model_type=qwen9_vl: one of siglip_vision_model"),
        ({**VISION, "depht": 2}, "model.vision_config.depht: Qwen2_5_VLVisionConfig has no such field"),
        ({**VISION, "out_hidden_size": 8}, "model.vision_config.out_hidden_size: set by the assembly"),
        ({"image_size": 32, "patch_sise": 16}, "model.vision_config.patch_sise: SiglipVisionConfig has no such field"),
    ],
)
def test_a_misspelt_model_type_or_field_is_one_error_naming_the_key(llama_folder, tmp_path, monkeypatch, vision, key):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    cfg = ModelConfig(name_or_path="tiny-llama", vision_config=vision)
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_processor(cfg, str(llama_folder))
    assert not list((tmp_path / "models").glob("*/config.json"))  # nothing assembled


def test_the_recipes_packed_rows_are_checked_against_the_assembled_class(llama_folder):
    """recipes/vlm_qwen.yaml keeps data.batching=packed: the assembled class is checked as a hub Qwen2.5-VL folder
    would be, and its packed rows pass (the collator makes each sequence's mrope positions); a class that cannot
    pack (Gemma3) is refused by the same check."""
    from transformers import Gemma3Config, Qwen2_5_VLConfig

    cfg = load_config(["recipe=recipes/vlm_qwen.yaml"])
    assert cfg.model.vision_config["model_type"] == "qwen2_5_vl" and cfg.data.batching == "packed"
    assert cfg.model.freeze == TOWER and cfg.optim.lr_multipliers == {"model.visual.merger": 10}
    assert packing_refusal(Qwen2_5_VLConfig()) is None and packing_refusal(Gemma3Config()) is not None
    assert is_vlm(cfg.model, cfg.data, resolve_plan(cfg, 1), str(llama_folder))
    padded = load_config(["recipe=recipes/vlm_qwen.yaml", "data.batching=padded", "eval.batching=padded"])
    assert is_vlm(padded.model, padded.data, resolve_plan(padded, 1), str(llama_folder))


def test_the_dummy_image_of_a_hub_qwen_processor_is_its_smallest_image():
    """A hub Qwen2.5-VL's image processor keeps min_pixels=3136 as its size's shortest_edge (an area): the dummy image
    every image-less micro-batch runs through the tower is 56 px (4 image tokens), not 3,136 px (12,544)."""
    from types import SimpleNamespace

    from transformers import Qwen2VLImageProcessorPil

    from finetune.model.vlm import black_image, dummy_image_inputs

    processor = SimpleNamespace(image_processor=Qwen2VLImageProcessorPil())  # the hub model's defaults
    assert black_image(processor).size == (56, 56)
    assert dummy_image_inputs(processor)["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.e2e
def test_verify_passes_on_the_qwen_recipe_packed(llama_folder, monkeypatch, capsys, tmp_path):
    """`python -m finetune.verify recipe=recipes/vlm_qwen.yaml data.batching=packed` at test size: the recipe's
    assembly over a tiny Llama, packed rows whose mrope positions the collator makes per sequence; the applied
    gradient matches the float64 per-sequence reference."""
    from finetune.tools import verify

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    code = verify.main(
        [
            "recipe=recipes/vlm_qwen.yaml",
            f"model.name_or_path={llama_folder}",
            "model.gguf_file=null",
            "data.batching=packed",
            "data.limit=24",
            "train.max_steps=1",
            "optim.name=sgd",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "attention: packed_sdpa" in out
    error = float(re.search(r"^  relative error (\S+)", out, flags=re.M).group(1))
    assert error <= 1e-5
