"""A quantized base (model.quantization: bitsandbytes 4-bit and 8-bit through transformers' BitsAndBytesConfig) with
LoRA, and bitsandbytes' 8-bit and paged AdamW (optim.name): what loads is quantized, what trains is exact, and every
bad setting is one line naming its key, before the model loads. All on the CPU (bitsandbytes' CPU backend)."""

import importlib.util
import json
import shutil

import pytest
import torch

from finetune.model import describe, loading
from finetune.model.freeze import check_lora
from finetune.recipe import RecipeError, load_config
from tests.launch import ROOT, run

DEBUG = f"recipe={ROOT / 'recipes' / 'debug.yaml'}"
QLORA = [DEBUG, "model.quantization.bits=4", "model.lora.enabled=true", "model.lora.target_modules=all-linear"]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def loaded(argv: list[str]):
    cfg = load_config(argv)
    return loading.load_model(cfg.model, loading.model_folder(cfg.model))


@pytest.mark.parametrize(
    "bits, kind, weight_dtype",
    [("4", "Linear4bit", torch.uint8), ("8", "Linear8bitLt", torch.int8)],
)
def test_every_linear_layer_of_the_base_is_quantized_and_only_the_adapters_train(bits, kind, weight_dtype):
    """Nothing trains in full precision when 4-bit (or 8-bit) was asked: each of the base's linear layers under the
    adapter IS bitsandbytes' quantized layer; the head stays in model.dtype; only lora_A/lora_B train."""
    model = loaded([*QLORA, f"model.quantization.bits={bits}"])
    base = model.get_base_model()
    layers = [(n, m) for n, m in base.named_modules() if n.endswith(LINEARS) and hasattr(m, "base_layer")]
    assert len(layers) == 2 * len(LINEARS)  # the debug model's two decoder layers
    for name, module in layers:
        assert type(module.base_layer).__name__ == kind, name
        assert module.base_layer.weight.dtype == weight_dtype and not module.base_layer.weight.requires_grad
    assert isinstance(base.lm_head, torch.nn.Linear) and base.lm_head.weight.dtype == torch.float32
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert (
        getattr(base, f"is_loaded_in_{bits}bit")
        and base.hf_quantizer.quantization_config.quant_method == "bitsandbytes"
    )


def test_a_mixture_of_experts_says_its_experts_stay_unquantized(tmp_path):
    """transformers keeps each layer's experts as fused 3-D weights, which bitsandbytes does not quantize: the
    start-up line gives their count and size, as the loaded model holds them."""
    from transformers import AutoTokenizer

    from finetune.model.quantized import unquantized_experts_line
    from finetune.testing.families import family_folder
    from tests.data_files import smollm2_folder

    folder = family_folder(tmp_path, "qwen3_moe", AutoTokenizer.from_pretrained(str(smollm2_folder())))
    cfg = load_config([*QLORA, f"model.name_or_path={folder}", "model.gguf_file=null"])
    model = loading.load_model(cfg.model, str(folder))
    text = model.get_base_model().config
    per_layer = text.num_experts * 3 * text.hidden_size * text.moe_intermediate_size  # gate and up, then down
    count = per_layer * text.num_hidden_layers
    assert unquantized_experts_line(model, cfg.model) == (
        f"note: model.quantization.bits=4: {count:,} parameters of the experts' fused weights are not quantized "
        "(bitsandbytes quantizes linear layers; transformers keeps each layer's experts as 3-D weights): "
        f"{count * 4 / 2**30:.2f} GiB in torch.float32 after peft's k-bit preparation"
    )
    assert unquantized_experts_line(loaded(QLORA), cfg.model) is None  # a dense model: no line


def test_the_4bit_keys_reach_bitsandbytes():
    model = loaded(
        [*QLORA, "model.quantization.bnb_4bit_quant_type=fp4", "model.quantization.bnb_4bit_use_double_quant=false"]
    )
    weight = model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight
    assert weight.quant_state.quant_type == "fp4" and weight.quant_state.nested is False
    model = loaded(QLORA)  # the defaults: NF4, double quantization (the absmax scales quantized too)
    weight = model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight
    assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested is True


# ---- bad settings: one line naming the key, before the model loads ----


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [DEBUG, "model.quantization.bits=4"],
            r"^model\.quantization\.bits=4: the quantized base weights cannot train; set model\.lora\.enabled=true",
        ),
        (
            [*QLORA, "model.lora.merge=true"],
            r"^model\.lora\.merge=true with model\.quantization\.bits=4: .*set model\.lora\.merge=false",
        ),
        ([DEBUG, "model.quantization.bits=2"], r"^model\.quantization\.bits='2' is not one of none, 4, 8"),
        (
            [*QLORA, "model.quantization.bnb_4bit_quant_type=nf3"],
            r"^model\.quantization\.bnb_4bit_quant_type='nf3' is not one of nf4, fp4",
        ),
        ([DEBUG, "optim.name=adamw8bit"], r"^optim\.name='adamw8bit' is not one of .*did you mean 'adamw_8bit'\?"),
    ],
)
def test_a_bad_quantization_setting_is_one_error_naming_the_key(argv, message):
    with pytest.raises(RecipeError, match=message) as error:
        load_config(argv)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "argv, key",
    [([DEBUG, "optim.name=paged_adamw_8bit"], "optim.name=paged_adamw_8bit"), (QLORA, "model.quantization.bits=4")],
)
def test_bitsandbytes_missing_is_one_error_naming_the_key_and_the_install(argv, key, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    with pytest.raises(
        RecipeError, match=rf"^{key} needs bitsandbytes, which is not installed; pip install bitsandbytes$"
    ):
        load_config(argv)


def test_a_base_that_is_already_quantized_is_refused_before_it_loads(tmp_path):
    """A folder whose config.json names a quantization (GPTQ, AWQ, bitsandbytes…): bitsandbytes would quantize
    nothing or fail deep inside transformers; one line instead, from the folder's config alone."""
    cfg = load_config(QLORA)
    folder = tmp_path / "gptq"
    shutil.copytree(loading.model_folder(cfg.model), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(
        RecipeError, match=r"^model\.quantization\.bits=4: model\.name_or_path=\S+ is already quantized \(gptq\)"
    ):
        check_lora(cfg.model, str(folder), vision=False)


def test_the_exact_token_mean_gradient_reaches_every_optimizer_unchanged(tmp_path):
    """The optimizer takes the gradient, never makes it: step 1's loss and gradient norm are bitwise the same under
    torch's AdamW and each bitsandbytes AdamW, on the same 4-bit base; paged states (host memory on a CPU) are the
    same states, so step 2 is the same too."""
    from finetune.tools.train import train

    runs = {}
    for name in ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw"):
        out = tmp_path / name
        argv = [*QLORA, "model.lora.r=64", f"optim.name={name}", "optim.lr=1e-2", "train.max_steps=2"]
        assert train(load_config([*argv, "data.limit=16", f"train.output_dir={out}", "log.wandb_mode=disabled"])) == 0
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        runs[name] = [(e["loss"], e["grad_norm"]) for e in history if "grad_norm" in e]
    assert len({steps[0] for steps in runs.values()}) == 1, runs
    assert runs["paged_adamw_8bit"] == runs["adamw_8bit"], runs  # paging moves states, never changes them


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_offloading_keeps_every_gradient_bitwise_and_offloads_the_saved_tensors(
    checkpointing, tmp_path, monkeypatch
):
    """train.activation_offloading: what autograd saves in the training forward goes through torch's save_on_cpu
    (counted here), with or without gradient checkpointing; the same values come back, so every step's loss and
    gradient norm are bitwise those of the run without it."""
    from finetune.tools.train import train

    class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        packed = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook

            def counted(tensor):
                CountingSaveOnCpu.packed += 1
                return pack(tensor)

            self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    runs, packed = {}, {}
    for offloading in (False, True):
        out = tmp_path / str(offloading)
        argv = [DEBUG, "data.limit=16", "train.max_steps=2", f"train.gradient_checkpointing={checkpointing}"]
        argv += [f"train.activation_offloading={offloading}", f"train.output_dir={out}", "log.wandb_mode=disabled"]
        before = CountingSaveOnCpu.packed
        assert train(load_config(argv)) == 0
        packed[offloading] = CountingSaveOnCpu.packed - before
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        runs[offloading] = [(e["loss"], e["grad_norm"]) for e in history if "grad_norm" in e]
    assert packed[False] == 0 and packed[True] > 0, packed
    assert runs[True] == runs[False] and len(runs[True]) == 2, runs


def lora_gradients(model, batch: dict) -> dict:
    """Each adapter weight's gradient of one training forward and backward (train mode, as a training step)."""
    model.train()
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_an_evaluation_on_an_avx512_cpu_leaves_the_4bit_weights_as_training_reads_them(monkeypatch):
    """bitsandbytes repacks a Linear4bit's weight in place, on a CPU with AVX-512 BF16, at its first eval-mode forward
    without gradient; its kernel for that layout has no autograd (the adapters below it would get zero input
    gradients). The path is forced on here whatever this CPU has: after an evaluation forward, no layer is repacked,
    and the adapters' gradients equal those over bitsandbytes' own dequantization of the same base."""
    import bitsandbytes.nn.modules

    from finetune.model.quantized import dequantize_base

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)
    model = loaded([*QLORA, "model.quantization.bnb_4bit_compute_dtype=float32"])
    layers = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert layers and all(m.weight.quant_state is not None for m in layers)
    with torch.no_grad():  # lora_B starts at zero, which would leave every lora_A without a gradient
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    model.eval()
    with torch.no_grad():  # what an evaluation, a sample or verify's reference pass runs
        model(**batch)
    assert not [m for m in layers if getattr(m.weight.quant_state, "packing_format_for_cpu", False)]
    got = lora_gradients(model, batch)
    reference = lora_gradients(dequantize_base(model), batch)
    assert got.keys() == reference.keys() and len(got) == 4 * len(LINEARS)
    for name, grad in got.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(grad, reference[name], rtol=1e-4, atol=1e-7), name


@pytest.mark.subprocess  # what libraries print when they are first imported: a fresh process's stderr
def test_a_qlora_run_with_an_evaluation_prints_nothing_on_stderr(tmp_path):
    """A 4-bit base with LoRA that evaluates before and between its steps: peft imports bitsandbytes, which on a CPU
    with AVX-512 BF16 logs a kernel it could not fetch, and the evaluation is where it would repack the weights (torch
    then warns of a kernel with no autograd). The run's stderr holds no line at all, on either kind of CPU."""
    out = tmp_path / "out"
    argv = [*QLORA, "train.max_steps=1", "data.limit=16", "eval.fraction=0.25", "eval.limit=2", "eval.every_steps=1"]
    result = run([*argv, f"train.output_dir={out}", "log.wandb_mode=disabled"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr
    assert "eval loss" in result.stdout or "eval_loss" in result.stdout, result.stdout[-2000:]


# ---- the start-up lines: what trains, read from the loaded model ----

# the debug Llama's frozen parameters outside its 14 linear layers: the tied embedding (SmolLM2's 49,152 tokens × 64)
# and 5 RMSNorm weights of 64 (2 per layer and the last)
FROZEN_OUTSIDE = 49_152 * 64 + 5 * 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's unpaged fallback (a GPU pages the states)")
def test_the_start_up_lines_say_the_quantization_the_adapter_and_the_optimizer_as_it_runs(tmp_path, capsys, recwarn):
    """A 4-bit NF4 base with LoRA and paged 8-bit AdamW on a CPU: the start says how the weights are held, what the
    adapter is and that paging falls back to unpaged here, once, in the project's words; bitsandbytes' own warning
    of the fallback is issued at the first step (the optimizer records it) but filtered, not shown raw."""
    from finetune.assemble import build

    argv = [*QLORA, "model.lora.r=16", "model.lora.alpha=32", "optim.name=paged_adamw_8bit", "train.max_steps=1"]
    cfg = load_config([*argv, "data.limit=16", f"train.output_dir={tmp_path}", "log.wandb_mode=disabled"])
    trainer = build(cfg)
    trainer.train()
    lines = capsys.readouterr().out.splitlines()
    said = {line.split(":", 1)[0]: line for line in lines if line.startswith(("weights:", "LoRA:", "optimizer:"))}
    assert said == {
        "weights": "weights: 4-bit NF4, double quantization, compute dtype float32 (bitsandbytes) in 14 linear "
        f"layers; the other {FROZEN_OUTSIDE:,} frozen parameters in float32",
        "LoRA": "LoRA: rank 16, alpha 32 (scale 2), dropout 0 on 14 layers (down_proj, gate_proj, k_proj, o_proj, "
        "q_proj, up_proj, v_proj); adapters in float32",
        "optimizer": "optimizer: paged_adamw_8bit (bitsandbytes PagedAdamW8bit, 8-bit states for tensors of 4,096+ "
        "elements; paging is CUDA-only, on this CPU it runs unpaged)",
    }, lines
    assert sum(line.startswith("optimizer:") for line in lines) == 1
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert optimizer.is_paged and optimizer._cpu_paged_warned  # bitsandbytes took its CPU fallback and warned
    assert not [w for w in recwarn if "Paged optimizers" in str(w.message)], [str(w.message) for w in recwarn]


def test_the_weights_line_reads_fp4_the_compute_dtype_and_8_bit_from_the_layers():
    fp4 = loaded(
        [
            *QLORA,
            "model.quantization.bnb_4bit_quant_type=fp4",
            "model.quantization.bnb_4bit_use_double_quant=false",
            "model.quantization.bnb_4bit_compute_dtype=bfloat16",
        ]
    )
    assert describe.weights_line(fp4) == (
        "weights: 4-bit FP4, no double quantization, compute dtype bfloat16 (bitsandbytes) in 14 linear layers; the "
        f"other {FROZEN_OUTSIDE:,} frozen parameters in float32"
    )
    eight = loaded([*QLORA, "model.quantization.bits=8", "model.lora.target_modules=[q_proj, v_proj]"])
    assert describe.weights_line(eight) == (
        "weights: 8-bit LLM.int8, outlier threshold 6 (bitsandbytes) in 14 linear layers; the other "
        f"{FROZEN_OUTSIDE:,} frozen parameters in float32"
    )
    # the recipe's defaults: rank 8, alpha 16; adapters on q_proj and v_proj of both layers
    assert describe.adapter_line(eight) == (
        "LoRA: rank 8, alpha 16 (scale 2), dropout 0 on 4 layers (q_proj, v_proj); adapters in float32"
    )
    plain = loaded([DEBUG, "model.dtype=bfloat16"])
    assert describe.weights_line(plain) == "weights: bfloat16" and describe.adapter_line(plain) is None


@pytest.mark.parametrize(
    "name, gpu, expected",
    [
        ("adamw", False, "optimizer: adamw (torch AdamW, foreach)"),
        ("adamw", True, "optimizer: adamw (torch AdamW, fused)"),
        ("sgd", False, "optimizer: sgd (torch SGD, foreach)"),
        ("lamb", True, "optimizer: lamb (LAMB on torch's foreach ops, finetune/training/optim.py)"),
        (
            "adamw_8bit",
            False,
            "optimizer: adamw_8bit (bitsandbytes AdamW8bit, 8-bit states for tensors of 4,096+ elements)",
        ),
        (
            "paged_adamw",
            False,
            "optimizer: paged_adamw (bitsandbytes PagedAdamW, 32-bit states; paging is CUDA-only, on this CPU it runs "
            "unpaged)",
        ),
        (
            "paged_adamw_8bit",
            True,
            "optimizer: paged_adamw_8bit (bitsandbytes PagedAdamW8bit, 8-bit states for tensors of 4,096+ elements; "
            "states of 100k+ elements paged to host memory when the GPU runs short)",
        ),
    ],
)
def test_the_optimizer_line_names_the_implementation_that_steps(name, gpu, expected):
    from finetune.recipe import OptimConfig
    from finetune.training.optim import build_optimizer, optimizer_line

    assert optimizer_line(OptimConfig(name=name), gpu) == expected
    if name in ("adamw", "sgd") and not gpu:  # the line's implementation is the one build_optimizer picks
        built = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(name=name), 1e-3)
        assert built.defaults["foreach"] and not built.defaults.get("fused")
    assert optimizer_line(OptimConfig(name="adamw"), True, grad_scaled=True).endswith("foreach)")  # fp16's GradScaler
