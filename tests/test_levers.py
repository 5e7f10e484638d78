"""The speed levers (finetune/model/layer_kernels.py), off by default: `model.liger_kernels` refused on a CPU before
the model loads and put on the model instance, also a LoRA model's over a 4-bit base (Liger's triton kernels cannot
run on a CPU: its modules compute through torch references of the same math here, every call counted), and
`train.compile_layers` training the debug recipe as the eager layers do (alone, with gradient checkpointing and LoRA,
and with LoRA on a 4-bit base)."""

import copy
import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import finetune
from finetune import TokenNormTrainer, assemble
from finetune.core.causal_forward import foreign_forward
from finetune.model import layer_kernels
from finetune.recipe import ModelConfig, RecipeError, load_config
from finetune.recipe.checks import levers_on_device
from finetune.testing.toy import ragged_rows, step_errors, tiny_llama, train_recording

ROOT = Path(__file__).resolve().parents[1]
COMPILED = "train.compile_layers=true"
DEBUG = [f"recipe={ROOT / 'recipes' / 'debug.yaml'}", "log.wandb_mode=disabled", "train.save_steps=0"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_liger_kernels_on_a_cpu_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    def loads(*args, **kwargs):
        raise AssertionError("the tokenizer and model were loaded before the refusal")

    monkeypatch.setattr(assemble, "load_tokenizer", loads)
    monkeypatch.setattr(assemble, "load_model", loads)
    cfg = load_config([*DEBUG, f"train.output_dir={tmp_path}", "model.liger_kernels=true"])
    with pytest.raises(RecipeError, match=r"^model.liger_kernels=true needs a CUDA GPU \(Liger's kernels are triton"):
        finetune.build(cfg)
    assert not any(tmp_path.iterdir())


def test_liger_kernels_without_liger_installed_says_how_to_install(monkeypatch):
    model = ModelConfig(name_or_path="x", liger_kernels=True)
    assert levers_on_device(model, "NVIDIA H100 80GB HBM3") is None  # installed here
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else find_spec(name)
    )
    assert levers_on_device(model, "NVIDIA H100 80GB HBM3") == (
        "model.liger_kernels=true needs liger-kernel, which is not installed: pip install liger-kernel"
    )
    assert levers_on_device(ModelConfig(name_or_path="x"), None) is None  # off: nothing to check


def test_liger_kernels_on_a_family_liger_lacks_is_one_line():
    pytest.importorskip("liger_kernel")
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=61))
    with pytest.raises(RecipeError, match=r"^model.liger_kernels=true: Liger has no kernels for model type 'gpt2'"):
        layer_kernels.use_liger_kernels(model)


@pytest.fixture
def liger_math(monkeypatch) -> Counter:
    """Liger's RMSNorm, SwiGLU and RoPE computing through torch (counted); transformers' Llama module restored after."""
    liger = pytest.importorskip("liger_kernel.transformers")
    from liger_kernel.transformers import monkey_patch
    from transformers.models.llama import modeling_llama

    for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    rope, calls = modeling_llama.apply_rotary_pos_emb, Counter()

    def rms_norm(self, x):
        calls["rms_norm"] += 1
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon))).to(x.dtype)

    def swiglu(self, x):
        calls["swiglu"] += 1
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def rotary(*args, **kwargs):
        calls["rope"] += 1
        return rope(*args, **kwargs)

    monkeypatch.setattr(liger.LigerRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(liger.LigerSwiGLUMLP, "forward", swiglu)
    monkeypatch.setattr(monkey_patch, "liger_rotary_pos_emb", rotary)
    return calls


def test_liger_kernels_go_on_the_instance_under_the_trainers_head_and_loss(liger_math, tmp_path):
    from transformers.models.llama import modeling_llama

    classes = modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP
    initial = tiny_llama()
    model = copy.deepcopy(initial)
    assert layer_kernels.use_liger_kernels(model).startswith("liger: llama's RMSNorm, SwiGLU and RoPE")
    assert foreign_forward(model) is None  # no lce_forward: the causal LM forward stays transformers'
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == classes  # a later model is transformers' own
    later = tiny_llama()
    assert "forward" not in vars(later.model.norm) and "forward" not in vars(later.model.layers[0].mlp)
    trainer, windows, snapshots = train_recording(TokenNormTrainer, model, ragged_rows(12, seed=8), tmp_path, 2, 3)
    layers, forwards = model.config.num_hidden_layers, 6  # 2 steps × 3 micro-batches
    assert dict(liger_math) == {
        "rms_norm": (2 * layers + 1) * forwards,
        "swiglu": layers * forwards,
        "rope": layers * forwards,
    }
    for error, _ in step_errors(initial, windows, snapshots):  # the float64 brute force of each window
        assert error <= 1e-5


@pytest.mark.e2e
def test_liger_kernels_reach_a_lora_model_on_a_4bit_base_and_train_as_without(liger_math, monkeypatch, tmp_path):
    """The debug recipe with LoRA on an NF4 base (bitsandbytes' CPU backend), Liger on (its modules through the torch
    math above; the CPU refusal lifted): every norm, MLP and RoPE of the quantized model under peft's wrapper runs
    Liger's module, and the steps and LoRA weights are those of the same run without Liger."""
    qlora = ["model.quantization.bits=4", "model.lora.enabled=true"]
    plain_steps, plain = trained(qlora, tmp_path / "plain")
    assert not liger_math
    monkeypatch.setattr(assemble, "levers_on_device", lambda model, gpu: None)
    steps, weights = trained([*qlora, "model.liger_kernels=true"], tmp_path / "liger")
    layers, forwards = 2, 4  # the debug model's layers; 2 steps × 2 micro-batches
    assert dict(liger_math) == {
        "rms_norm": (2 * layers + 1) * forwards,
        "swiglu": layers * forwards,
        "rope": layers * forwards,
    }
    assert steps == plain_steps
    assert weights.keys() == plain.keys()
    assert [name for name in plain if not torch.equal(weights[name], plain[name])] == []


def trained(overrides: list[str], output_dir: Path) -> tuple[list[dict], dict]:
    """Each step's logged loss and grad norm, and the final weights, of the debug recipe at 2 steps."""
    steps = []

    class Steps(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({key: logs[key] for key in ("loss", "grad_norm")})

    cfg = load_config([*DEBUG, f"train.output_dir={output_dir}", "train.max_steps=2", *overrides])
    trainer = finetune.build(cfg, evaluate=False, callbacks=[Steps()])
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    compiled = [layer._compiled_call_impl is not None for layer in layer_kernels.decoder_layers(model)]
    assert compiled == [COMPILED in overrides] * len(compiled)
    return steps, {name: p.detach().clone() for name, p in model.state_dict().items()}


@pytest.mark.slow  # slow: inductor builds the compiled layers' C++ kernels on the CPU, 30-60 s a case on a cold cache
@pytest.mark.e2e
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["train.gradient_checkpointing=true", "model.lora.enabled=true"],
        ["model.quantization.bits=4", "model.lora.enabled=true"],
    ],
    ids=["compiled", "compiled-checkpointed-lora", "compiled-qlora"],
)
def test_compiled_layers_train_as_the_eager_layers(overrides, tmp_path):
    """SGD: a weight moves by lr × its gradient, so the final weights compare the gradients (AdamW's first steps
    normalize near-zero gradient entries to ±lr, where a last-bit difference moves a weight by up to 0.9 % of lr)."""
    overrides = [*overrides, "optim.name=sgd"]
    eager_steps, eager = trained(overrides, tmp_path / "eager")
    torch._dynamo.utils.counters.clear()
    steps, weights = trained([*overrides, COMPILED], tmp_path / "compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the layers ran compiled
    assert weights.keys() == eager.keys()  # compiled in place: the state dict's names are the eager model's
    for got, want in zip(steps, eager_steps, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= RTOL * abs(want[key]), (key, got, want)
    moved = max((weights[name] - eager[name]).abs().max().item() for name in eager)
    assert moved <= WEIGHT_ATOL, moved


# Measured on a CPU (2026-11-27, torch 2.13): the losses equal bit for bit, grad norms within 1.2e-7 (relative), final
# weights within 3.7e-9 (alone), 2.9e-11 (checkpointed LoRA) and 2.9e-11 (LoRA on the NF4 base, bitsandbytes' CPU
# backend); the bounds are ~10× and float32's ulp at 1.
RTOL, WEIGHT_ATOL = 1e-6, 1e-7
