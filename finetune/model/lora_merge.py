"""`model.lora.merge`: the final save and `best/` hold the merged full model (`AutoModelForCausalLM.from_pretrained`
loads it without peft), the adapter beside it in `adapter/`. Checkpoints keep the adapter only: a resume needs it.

The merge is computed from the whole state dict (`accelerator.get_state_dict`: FSDP and ZeRO-3 gather it), never in
place on the training model: peft's merge_and_unload would end the LoRA training, and merge + unmerge does not give
the same floats back, so a mid-run save of `best/` would change the run. Each LoRA layer's base weight becomes
W + (B @ A) * scaling, transposed for fan_in_fan_out layers (GPT-2's Conv1D), as peft's own merge computes it.
"""

from __future__ import annotations

import os
import shutil

import torch

ADAPTER = "adapter"  # the folder beside the merged model that holds the adapter
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md")
LORA_A, LORA_B, BASE = ".lora_A.{}.weight", ".lora_B.{}.weight", ".base_layer."


def merged_state_dict(state: dict[str, torch.Tensor], peft_model) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own key names) with every LoRA layer merged into its base weight."""
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter
    prefix = "base_model.model."
    layers = {name.removeprefix(prefix): m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    merged = {}
    for key, value in state.items():
        key = key.removeprefix(prefix)
        if ".lora_" in key:
            continue
        merged[key.replace(BASE, ".")] = value
    for name, layer in layers.items():
        a, b = state[prefix + name + LORA_A.format(adapter)], state[prefix + name + LORA_B.format(adapter)]
        weight = state[prefix + name + BASE + "weight"]
        compute = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        delta = (b.to(compute) @ a.to(compute)) * layer.scaling[adapter]
        delta = delta.T if layer.fan_in_fan_out else delta
        merged[f"{name}.weight"] = weight + delta.to(weight.dtype)
    known = (LORA_A.format(adapter), LORA_B.format(adapter))
    unknown = [k for k in state if ".lora_" in k and not k.endswith(known)]
    if unknown:  # DoRA magnitudes, embedding LoRA: a merge this function does not know
        raise RuntimeError(f"cannot merge LoRA parameter {unknown[0]}")
    return merged


def write_merged(trainer, folder: str) -> None:
    """After `trainer.save_model(folder)` wrote the adapter (a model.lora.merge run: RecipeTrainer's `merge_lora`): the
    adapter moves into folder/adapter and the merged full model is written in its place (every rank: the state dict is
    gathered)."""
    state = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.args.should_save:
        return
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    os.makedirs(os.path.join(folder, ADAPTER), exist_ok=True)
    for name in ADAPTER_FILES:
        if os.path.exists(os.path.join(folder, name)):
            shutil.move(os.path.join(folder, name), os.path.join(folder, ADAPTER, name))
    base = peft_model.get_base_model()
    base.save_pretrained(folder, state_dict=merged_state_dict(state, peft_model))
