"""Mixed precision across sharded ranks: FSDP2 under bf16 accumulates and reduces the window's gradients in float32
and saves its best model whole; ZeRO-3's config exists before the model is built and its partitioned shapes are the
whole shapes at resume; under DeepSpeed the non-finite verdict is taken before the last backward. GPU-only behaviour
is in tests marked `gpu`.
"""

import json
import os
import subprocess

import pytest
import torch

from finetune.testing.reference import relative_error
from tests.debug_model import debug_model_keys
from tests.launch import ACCELERATE, ROOT, forked_ranks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---- FSDP2 under bf16: the window's gradients accumulated and reduced in float32 ----


@pytest.mark.distributed
def test_fsdp2_bf16_accumulates_and_reduces_gradients_in_float32(tmp_path):
    from tests.workers import fsdp2_precision_worker

    out = tmp_path / "precision.pt"
    forked_ranks(fsdp2_precision_worker.main, str(out))
    r = torch.load(out, weights_only=False)
    assert r["default_reduce_dtype"] == r["param_dtype"] == "torch.bfloat16"  # accelerate's policy: the bug
    assert r["fp32_reduce_dtype"] == "torch.float32"
    # The micro-batches' bf16 gradients, summed over the window and the ranks: exact in float32, off in bf16
    assert relative_error(r["fp32_reduce"], r["bf16_summed_in_float64"]) <= 1e-6
    assert relative_error(r["default"], r["bf16_summed_in_float64"]) >= 1e-3
    assert relative_error(r["fp32_reduce"], r["reference"]) < relative_error(r["default"], r["reference"])


def test_full_state_dict_around_a_save_then_sharded_again():
    from accelerate.utils import FullyShardedDataParallelPlugin

    from finetune.training.distributed import full_state_dict

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    config = plugin.state_dict_config
    with full_state_dict(plugin):
        assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # what Trainer.save_model needs to write weights
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.state_dict_config is config


# a process: `accelerate launch --config_file accelerate_configs/fsdp2.yaml` is what makes the run FSDP2
@pytest.mark.subprocess
@pytest.mark.gpu
@needs_cuda  # accelerate's FSDP plugin (SHARDED_STATE_DICT checkpoints) needs a GPU; the switch itself is tested above
def test_fsdp2_best_model_is_saved_whole_and_the_run_goes_on(tmp_path):
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        "accelerate_configs/fsdp2.yaml",
        "--num_processes",
        "1",
        "finetune/train.py",
        "recipe=recipes/debug.yaml",
        "data.limit=40",
        "data.max_length=64",
        "eval.fraction=0.25",
        "eval.samples=0",
        "train.max_steps=3",
        "eval.every_steps=1",
        "eval.best_checkpoint=true",
        "train.save_steps=2",
        f"train.output_dir={tmp_path}",
        *debug_model_keys(),
    ]
    result = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "best" / "model.safetensors").is_file() and (tmp_path / "model.safetensors").is_file()
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] >= 1


# ---- ZeRO-3: the DeepSpeed config exists before the model is built ----


def test_training_arguments_exist_before_the_model_is_loaded(monkeypatch, tmp_path):
    """transformers registers ZeRO-3's config (zero3_init_flag → deepspeed.zero.Init at from_pretrained) when
    TrainingArguments is built: the model must be loaded after it (deepspeed is not needed to check the order)."""
    import transformers

    from finetune import assemble
    from finetune.recipe import load_config

    events = []
    post_init, load_model = transformers.TrainingArguments.__post_init__, assemble.loading.load_model

    def recording_post_init(self):
        events.append("TrainingArguments")
        post_init(self)

    def recording_load(*args, **kwargs):
        events.append("load_model")
        return load_model(*args, **kwargs)

    monkeypatch.setattr(transformers.TrainingArguments, "__post_init__", recording_post_init)
    monkeypatch.setattr(assemble.loading, "load_model", recording_load)
    assemble.build(load_config(["recipe=recipes/debug.yaml", "data.limit=16", f"train.output_dir={tmp_path}"]))
    assert events == ["TrainingArguments", "load_model"]


# ---- DeepSpeed: the verdict is taken before the last backward (engine.step() runs inside it) ----


class DecidesBeforeBackward:
    """The recipe trainer taking its verdict where it does under DeepSpeed, with a NaN loss in step 2's last
    micro-batch; without DeepSpeed the update still waits for the Trainer's optimizer step, so the test sees whether
    that early verdict vetoes the right step (step 2) and no other."""

    def decides_before_backward(self) -> bool:
        return True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.state.global_step + 1 == 2 and model.training and self.accelerator.sync_gradients:
            original = model.forward

            def nan_forward(*args, **kwargs):
                output = original(*args, **kwargs)
                output.logits = output.logits * float("nan")
                return output

            model.forward = nan_forward
            try:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                model.forward = original
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def deepspeed_like_run(tmp_path, on_nonfinite: str):
    from finetune.assemble import build
    from finetune.recipe import load_config
    from finetune.training.recipe_trainer import RecipeTrainer

    cfg = load_config(
        [
            "recipe=recipes/debug.yaml",
            "data.limit=16",
            "data.max_length=64",
            "train.max_steps=3",
            "train.save_steps=1",
            f"train.output_dir={tmp_path}",
            f"train.on_nonfinite={on_nonfinite}",
        ]
    )
    return build(cfg, trainer_cls=type("Trainer", (DecidesBeforeBackward, RecipeTrainer), {}))


@pytest.mark.e2e
def test_verdict_before_the_last_backward_vetoes_that_step_and_not_the_next(tmp_path):
    from safetensors.torch import load_file

    trainer = deepspeed_like_run(tmp_path, "skip")
    trainer.train()
    logs = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert [e["nonfinite_skipped"] for e in logs] == [0, 1, 1]
    after_1, after_2, after_3 = (load_file(tmp_path / f"checkpoint-{k}" / "model.safetensors") for k in (1, 2, 3))
    assert all(torch.equal(after_1[n], after_2[n]) for n in after_1)  # step 2: no update
    assert not all(torch.equal(after_2[n], after_3[n]) for n in after_2)  # step 3: not vetoed by step 2's verdict


@pytest.mark.e2e
def test_stop_before_the_last_backward(tmp_path):
    from finetune.training.nonfinite import NonFiniteError

    trainer = deepspeed_like_run(tmp_path, "stop")
    with pytest.raises(NonFiniteError, match="optimizer step 2: the loss is not finite"):
        trainer.train()
    assert not (tmp_path / "checkpoint-2").exists()
    # Stopped before the NaN loss's backward (under DeepSpeed: before engine.step), not after it
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in trainer.model.parameters())


def test_resume_shapes_of_a_zero3_partitioned_model_are_the_whole_shapes():
    """zero.Init leaves each rank an empty partition of every weight: the shapes a checkpoint is checked against are
    the parameters' ds_shape, not the empty tensors' (a resume would be refused as another model)."""
    from finetune.testing.toy import tiny_llama
    from finetune.training.checkpoints import _model_shapes

    model = tiny_llama()
    whole, _ = _model_shapes(model, adapter=False)
    for param in model.parameters():  # what deepspeed.zero.Init leaves on a rank: empty data, the full ds_shape
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    partitioned, _ = _model_shapes(model, adapter=False)
    assert partitioned == whole


def test_resume_of_a_zero3_partitioned_tied_model_accepts_its_own_checkpoint(tmp_path):
    """A tied model saves embed_tokens.weight once (no lm_head.weight); under ZeRO-3 every partition is empty, so the
    tie is known from the shared Parameter, not from storage (the H200 ZeRO-3 resume was refused as another model)."""
    from finetune.recipe.fields import RecipeError
    from finetune.testing.toy import tiny_llama
    from finetune.training.checkpoints import check_same_model, tied_missing

    model = tiny_llama(tie=True)
    model.save_pretrained(tmp_path)
    for param in model.parameters():  # what deepspeed.zero.Init leaves on a rank: empty data, the full ds_shape
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    check_same_model(str(tmp_path), model)
    assert tied_missing(model, ["lm_head.weight"]) == []
    untied = tiny_llama(tie=False)
    with pytest.raises(RecipeError, match=r"not there \(e.g. lm_head.weight\)"):
        check_same_model(str(tmp_path), untied)
