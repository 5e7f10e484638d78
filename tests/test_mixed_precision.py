"""Mixed precision on the paths a CPU can run: fp16 overflow and the LR schedule, MFU peaks, the precision checks.

fp16 runs on a CPU through autocast and `torch.amp.GradScaler("cpu")` (accelerate itself gives a CPU no scaler, so
the optimizer is wrapped here as accelerate wraps it on a GPU). GPU-only behaviour is in tests marked `gpu`.
"""

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState

from finetune.training.optim import step_implementation
from tests.debug_model import debug_model_keys

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def lr_around_an_overflow(impl: dict) -> tuple[float, float, torch.Tensor]:
    """One fp16 step whose gradient overflows, as transformers' loop runs it: the scaler steps accelerate's optimizer,
    and the schedule steps unless accelerate reports the step skipped. (LR before, LR after, the weights after)."""
    AcceleratorState._reset_state(reset_partial_state=True)  # as TrainingArguments does
    Accelerator(cpu=True)  # AcceleratedOptimizer reads the accelerator's state
    weight = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.AdamW([weight], lr=0.1, **impl)
    scaler = torch.amp.GradScaler("cpu")
    accelerated = AcceleratedOptimizer(optimizer, device_placement=False, scaler=scaler)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.full((8,), 1e3) @ weight  # a finite fp16 loss; its gradient × the scale 65536 is past fp16's range
    scaler.scale(loss).backward()
    before = schedule.get_last_lr()[0]
    accelerated.step()
    if not accelerated.step_was_skipped:  # transformers 5.23 Trainer._run_epoch
        schedule.step()
    return before, schedule.get_last_lr()[0], weight.detach()


def test_fp16_overflow_leaves_the_schedule_where_it_was():
    impl = step_implementation(on_gpu=True, grad_scaled=True)  # what a fp16 run on a GPU gets
    before, after, weights = lr_around_an_overflow(impl)
    assert after == before == 0.1
    assert torch.equal(weights, torch.ones(8))
    # Why fused is refused: GradScaler calls a fused step() even on an overflow, and the schedule advances.
    before, after, weights = lr_around_an_overflow({"fused": True})
    assert (before, after) == (0.1, 0.05) and torch.equal(weights, torch.ones(8))


def test_fused_stays_where_no_scaler_decides():
    assert step_implementation(on_gpu=True, grad_scaled=False) == {"fused": True}
    assert step_implementation(on_gpu=False, grad_scaled=True) == {"foreach": True}


@pytest.mark.e2e
@pytest.mark.gpu
@needs_cuda  # a real fp16 run needs a GPU: accelerate gives a CPU no GradScaler
def test_fp16_run_on_a_gpu_does_not_advance_the_schedule_on_overflow(tmp_path, monkeypatch):
    from finetune.recipe import load_config
    from finetune.tools.train import train
    from finetune.training.recipe_trainer import RecipeTrainer

    compute_loss = RecipeTrainer.compute_loss

    def overflowing(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return loss * 7e4 if self.state.global_step + 1 == 2 and loss.requires_grad else loss

    monkeypatch.setattr(RecipeTrainer, "compute_loss", overflowing)
    cfg = load_config(
        [
            "recipe=recipes/debug.yaml",
            "data.limit=16",
            "data.max_length=64",
            "train.max_steps=3",
            "train.precision=fp16",
            "schedule.name=linear",
            f"train.output_dir={tmp_path}",
            "log.wandb_mode=disabled",
            *debug_model_keys(),
        ]
    )
    assert train(cfg) == 0
    history = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    lrs = [e["learning_rate"] for e in history if "grad_norm" in e]
    assert lrs[1] == lrs[2]  # step 2 overflowed: step 3 runs at step 2's LR


# ---- MFU's peak: the device variant and the precision the matmuls run in ----


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H100 PCIe", "fp32", 51.0),
        ("NVIDIA GH200 480GB", "bf16", 989.0),
        ("NVIDIA H200 NVL", "fp16", 835.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Tesla T4", "bf16", None),
        ("NVIDIA L40S", "fp32", 91.6),
        ("Some Other GPU", "bf16", None),
    ],
)
def test_peak_flops_of_each_device_variant(name, precision, tflops):
    from finetune.core.meter import device_peak_flops

    assert device_peak_flops(precision, device_name=name) == (tflops * 1e12 if tflops else None)


def test_compute_precision_follows_autocast_then_the_weights_dtype():
    from finetune.core.meter import compute_precision

    bf16_weights = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8).float()).to(torch.bfloat16)
    bf16_weights[1].float()  # a norm kept in fp32 does not decide: most weights are bf16
    assert compute_precision(False, False, bf16_weights) == "bf16"
    assert compute_precision(False, False, torch.nn.Linear(8, 8).half()) == "fp16"
    assert compute_precision(False, False, torch.nn.Linear(8, 8)) == "fp32"
    assert compute_precision(False, True, torch.nn.Linear(8, 8)) == "fp16"
    assert compute_precision(True, False, torch.nn.Linear(8, 8)) == "bf16"


@pytest.mark.gpu
@needs_cuda  # max_memory_allocated is CUDA's; a CPU's RSS high-water mark stays the process's
def test_peak_memory_is_per_log_window_on_a_gpu():
    from finetune.core.meter import WindowMeter

    meter = WindowMeter()
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del big
    meter.add([1, 1, 1, 1])
    first = meter.drain()["peak_mem_mb"]
    meter.add([1, 1, 1, 1])
    second = meter.drain()["peak_mem_mb"]
    assert first >= 256 and second < first - 200 and meter.peak_mem_mb == first


# ---- verify's reference under mixed precision ----


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def test_verify_reference_runs_in_its_own_dtype_not_the_runs_autocast():
    from finetune.tools.reference_check import reference_model

    AcceleratorState._reset_state(reset_partial_state=True)  # as TrainingArguments does: a new precision
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model, plain = tiny_llama(), tiny_llama()
    ids = torch.randint(0, 128, (1, 12))
    expected = plain(input_ids=ids).logits  # float32, no autocast
    prepared = accelerator.prepare_model(model)
    wrapped = prepared(input_ids=ids).logits
    assert not torch.allclose(wrapped, expected, atol=1e-4)  # the training forward ran in bf16
    reference = reference_model(accelerator, prepared)
    assert torch.equal(reference(input_ids=ids).logits, expected)
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.e2e
@pytest.mark.gpu
@needs_cuda  # fp16 has a GradScaler only on a GPU (accelerate gives a CPU none)
def test_verify_fp16_without_clipping_passes(capsys):
    from finetune.tools import verify

    keys = ["train.precision=fp16", "train.max_grad_norm=0", *debug_model_keys()]
    code = verify.main(["recipe=recipes/debug.yaml", *keys])
    out = capsys.readouterr().out
    assert code == 0 and "verify: PASS" in out, out


# ---- bad input: a precision the model or the device cannot run ----


def recipe(*keys):
    from finetune.recipe import load_config

    return load_config(["recipe=recipes/debug.yaml", *keys])


def test_fp16_for_a_model_loaded_in_bf16_is_one_error_naming_both_keys():
    from finetune.recipe import RecipeError

    with pytest.raises(RecipeError) as e:
        recipe("train.precision=fp16", "model.dtype=bfloat16")
    assert str(e.value) == (
        "train.precision=fp16 trains float32 weights under a GradScaler; set model.dtype=float32 "
        "(or use train.precision=bf16)"
    )


@pytest.mark.parametrize(
    ("keys", "gpu", "bf16", "expected"),
    [
        (
            ["train.precision=fp16"],
            None,
            False,
            "train.precision=fp16 needs a GPU; on a CPU use train.precision=bf16 or train.precision=fp32",
        ),
        (
            ["train.precision=bf16"],
            "Tesla V100-SXM2-16GB",
            False,
            "train.precision=bf16 needs bf16, which this GPU (Tesla V100-SXM2-16GB) does not have "
            "(Ampere or newer does); "
            "use train.precision=fp16 with model.dtype=float32, or train.precision=fp32",
        ),
        (
            ["train.precision=bf16", "model.dtype=bfloat16"],
            "Tesla T4",
            False,
            "train.precision=bf16 and model.dtype=bfloat16 needs bf16, which this GPU (Tesla T4) does not have "
            "(Ampere or "
            "newer does); use train.precision=fp16 with model.dtype=float32, or train.precision=fp32 with "
            "model.dtype=float32",
        ),
        (["train.precision=bf16"], "NVIDIA H100 80GB HBM3", True, None),
        (["train.precision=bf16"], None, False, None),  # CPU autocast runs bf16
        (["train.precision=fp16"], "Tesla T4", False, None),
    ],
)
def test_precision_the_device_cannot_run(keys, gpu, bf16, expected):
    from finetune.recipe.checks import precision_on_device

    cfg = recipe(*keys)
    assert precision_on_device(cfg.train, cfg.model, gpu, bf16) == expected


def test_bf16_weights_without_a_float32_copy_are_a_warning_not_an_error(tmp_path, capsys):
    from finetune.assemble import build

    build(recipe("model.dtype=bfloat16", "data.limit=16", f"train.output_dir={tmp_path}"))
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: model.dtype")]
    assert warnings == [
        "warning: model.dtype=bfloat16 trains bf16 weights without a float32 copy: updates smaller "
        "than 1/256 of a weight are rounded away; for exact small-lr updates use model.dtype=float32 "
        "with train.precision=bf16"
    ]
    assert recipe().model.dtype == "float32"  # the default keeps float32 weights: no warning
