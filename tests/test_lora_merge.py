"""model.lora.merge through the CLI on the debug recipe: the final save and best/ are merged full models that
`AutoModelForCausalLM.from_pretrained` loads without peft, with the logits of peft's own merge of the saved adapter;
model.lora.target_modules=all-linear; merge's bad input is one error line, exit 2, nothing written."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, set_seed

from finetune.model.loading import load_model, model_folder
from finetune.recipe import load_config
from tests.launch import call

BASE = ["recipe=recipes/debug.yaml", "data.limit=32", "log.wandb_mode=disabled"]
LORA = ["model.lora.enabled=true", "model.lora.merge=true"]
LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def run(capfd, argv: list[str], out: Path) -> subprocess.CompletedProcess:
    """finetune/train.py's main on the debug recipe with `argv`, in this process."""
    return call(capfd, [*BASE, f"train.output_dir={out}", *argv])


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.e2e
def test_merged_lora_loads_without_peft_with_peft_merged_logits(tmp_path, capfd):
    from peft import PeftModel

    out = tmp_path / "out"
    evaluation = ["eval.fraction=0.25", "eval.every_steps=2", "eval.samples=0", "eval.best_checkpoint=true"]
    result = run(capfd, [*LORA, "model.lora.target_modules=all-linear", *evaluation], out)
    assert result.returncode == 0, result.stderr[-4000:]
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    cfg = load_config([*BASE, "model.lora.enabled=false"])
    for folder in (out, out / "best"):
        assert not any(p.name.startswith("adapter_") for p in folder.iterdir()), sorted(os.listdir(folder))
        adapter = json.loads((folder / "adapter" / "adapter_config.json").read_text())
        assert {n.rsplit(".", 1)[-1] for n in adapter["target_modules"]} == LINEAR  # all-linear: all but the head

        merged, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched weights
        assert not any("lora" in name for name, _ in merged.named_parameters())

        set_seed(cfg.train.seed)  # the run's base weights: random init from the debug config, seeded as build does
        base = load_model(cfg.model, model_folder(cfg.model))
        before = logits(base, ids)
        peft_model = PeftModel.from_pretrained(base, folder / "adapter")
        trained = logits(peft_model, ids)
        reference = peft_model.merge_and_unload()
        assert not torch.allclose(before, trained, atol=1e-3)  # the adapter changed the model
        torch.testing.assert_close(logits(merged, ids), logits(reference, ids), rtol=0, atol=0)
        torch.testing.assert_close(logits(merged, ids), trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["model.lora.merge=true"],
            r"^error: model\.lora\.merge=true given but model\.lora\.enabled is false, so the full model would train; "
            r"set model\.lora\.enabled=true to train a LoRA adapter, or remove model\.lora\.merge$",
        ),
        (
            ["model.lora.enabled=true", "model.lora.target_modules=[all-linear,q_proj]"],
            r"^error: model\.lora\.target_modules=\['all-linear', 'q_proj'\]: all-linear already means every linear "
            r"layer; give it alone or list module names$",
        ),
        (
            [*LORA, "QUANTIZED"],
            r"^error: model\.lora\.merge=true: model\.name_or_path=\S+ is quantized \(bitsandbytes\); merging into "
            r"quantized weights changes them; set model\.lora\.merge=false \(the adapter is saved\) and merge it into "
            r"the full-precision base with peft$",
        ),
    ],
    ids=["merge without lora", "all-linear with names", "merge with a quantized base"],
)
def test_bad_merge_is_one_error_line_exit_2(tmp_path, capfd, argv, message):
    if "QUANTIZED" in argv:  # a folder whose config.json says its weights are 4-bit bitsandbytes
        cfg = load_config(BASE)
        config = json.loads((Path(model_folder(cfg.model)) / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
        folder = tmp_path / "quantized"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        argv = [a for a in argv if a != "QUANTIZED"] + [f"model.name_or_path={folder}", "model.gguf_file=null"]
    out = tmp_path / "out"
    result = run(capfd, argv, out)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-4000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    assert re.search(message, errors[0]), errors[0]
    written = [p for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
    assert written == [], f"left in the output directory: {written}"
