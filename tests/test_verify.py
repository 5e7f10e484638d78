"""`finetune.verify` on the debug recipe: passes on the real trainer, fails on a broken normalization, same recipe
errors as training, and on two CPU ranks (the window gathered from both, as on one process)."""

import re

import pytest
import torch

from finetune.recipe import RecipeError, load_config
from finetune.tools import verify
from finetune.tools.reference_check import group_of
from tests.launch import call, forked_ranks

DEBUG = "recipe=recipes/debug.yaml"


def errors_in(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^  relative error (\S+)", output, flags=re.M)]


def floors_in(output: str) -> list[float]:
    """Per step, the distance of the brute force in the run's own arithmetic from the float64 reference."""
    return [float(x) for x in re.findall(r"the brute force in the run's arithmetic (\S+), ", output)]


def weights_in(output: str) -> list[list[float]]:
    """Per step, the micro-batch weights verify fitted (1 when every target token counts once)."""
    lines = re.findall(r"^  micro-batch weights \(.*?\): ([\d. ]+?)  \(", output, flags=re.M)
    return [[float(w) for w in line.split()] for line in lines]


@pytest.mark.e2e
def test_passes_on_the_debug_recipe_with_clipping(capsys):
    code = verify.main([DEBUG, "verify.steps=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    errors = errors_in(out)
    assert len(errors) == 2 and max(errors) <= 1e-5
    # the debug recipe clips (max_grad_norm 1) and the windows are the recipe's 8 sequences
    assert len(re.findall(r"^step \d: 8 sequences, \d+ target tokens from 1 rank, clipped ×", out, flags=re.M)) == 2
    assert all(w == pytest.approx(1, abs=1e-6) for step in weights_in(out) for w in step)
    assert [len(step) for step in weights_in(out)] == [2, 2]  # micro 4 × accumulation 2
    assert "verify: PASS" in out


@pytest.mark.e2e
def test_bf16_passes_within_its_documented_tolerance(capsys):
    code = verify.main([DEBUG, "train.precision=bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    # bf16 rounding is visible (far above fp32's 1e-7) yet within bf16's tolerance; the weights stay near 1
    assert 1e-4 < errors_in(out)[0] <= verify.TOLERANCES["bf16"]
    assert all(abs(w - 1) <= verify.WEIGHT_TOLERANCES["bf16"] for w in weights_in(out)[0])
    # the floor is the autocast brute force's own distance from float64: bf16-sized, and ours is as close as it
    (floor,) = floors_in(out)
    assert 1e-4 < floor < 2e-2 and errors_in(out)[0] <= 2 * floor


@pytest.mark.e2e
def test_passes_on_packed_budgeted_rows_with_lora(capsys):
    """Packed rows are split back into their sequences; only the LoRA parameters are compared."""
    code = verify.main(
        [
            DEBUG,
            "data.batching=packed",
            "data.max_tokens_per_micro_batch=256",
            "train.global_batch_tokens=512",
            "model.lora.enabled=true",
            "train.max_grad_norm=0",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert max(errors_in(out)) <= 1e-5
    groups = re.findall(r"^    (\S+)\s+\S+\s+\(‖reference‖", out, flags=re.M)
    assert groups == ["model.layers.0", "model.layers.1"]  # q_proj/v_proj LoRA weights only


TINY = [  # recipes/debug.yaml's model (scripts/record_golden.py's TINY): SmolLM2's config shrunk, random init
    "model.from_config=true",
    "model.config_overrides.hidden_size=64",
    "model.config_overrides.intermediate_size=128",
    "model.config_overrides.num_hidden_layers=2",
    "model.config_overrides.num_attention_heads=4",
    "model.config_overrides.num_key_value_heads=2",
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "quantization",
    [
        [],
        ["model.quantization.bnb_4bit_use_double_quant=false"],
        ["model.quantization.bnb_4bit_quant_type=fp4"],
    ],
    ids=["nf4, double quantization (as shipped)", "nf4", "fp4"],
)
def test_passes_on_the_qlora_recipe_over_its_dequantized_base(quantization, capsys):
    """recipes/qlora.yaml at test size (4-bit NF4 base, LoRA on every linear layer, paged 8-bit AdamW, gradient
    checkpointing, packed rows), and with each other 4-bit layout: the reference runs in float64 over bitsandbytes'
    own dequantization of the 4-bit weights, and the applied gradient is within the floor of the brute force in the
    run's own arithmetic. verify's own no-gradient passes would repack the weights on an AVX-512 BF16 CPU (a layout
    with no autograd) if the loading did not keep them as training reads them."""
    argv = ["recipe=recipes/qlora.yaml", *TINY, "data.limit=32", "train.micro_batch_size=4", *quantization]
    code = verify.main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert max(errors_in(out)) <= 2 * max(floors_in(out)) and max(errors_in(out)) <= 1e-5, out
    groups = re.findall(r"^    (\S+)\s+\S+\s+\(‖reference‖", out, flags=re.M)
    assert groups == ["model.layers.0", "model.layers.1"]  # the adapters only: the 4-bit base is frozen


def test_an_8bit_base_is_refused_by_verify_in_one_line():
    with pytest.raises(RecipeError, match=r"^finetune\.verify: model\.quantization\.bits=8 \(LLM\.int8\) rounds"):
        verify.check_verifiable(load_config([DEBUG, "model.quantization.bits=8", "model.lora.enabled=true"]))


@pytest.mark.e2e
def test_fails_on_a_trainer_that_averages_per_micro_batch(capsys, monkeypatch):
    """A check that can fail: the classic bug (mean of micro-batch means) is reported far above tolerance."""
    import finetune.training.recipe_trainer

    class PerMicroBatchMean(finetune.training.recipe_trainer.RecipeTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if num_items_in_batch is not None:  # each micro-batch divided by its own targets, then by accumulation
                own = int((inputs["labels"][..., 1:] != -100).sum())
                num_items_in_batch = own * self.args.gradient_accumulation_steps
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    monkeypatch.setattr(finetune.training.recipe_trainer, "RecipeTrainer", PerMicroBatchMean)
    code = verify.main([DEBUG, "train.max_grad_norm=0"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert errors_in(out)[0] > 1e-2 and errors_in(out)[0] > 1000 * floors_in(out)[0]  # far above the floor too
    assert "verify: FAIL" in out and "above tolerance" in out
    # each micro-batch's tokens weighted by window tokens / (accumulation × its own tokens), not by 1
    (weights,) = weights_in(out)
    assert len(weights) == 2 and min(weights) < 0.95 and max(weights) > 1.05


def test_every_drop_probability_is_off_for_the_check():
    """torch's dropout modules, the probabilities a module copied from its config (SeedOSS's residual_dropout, DBRX's
    resid_pdrop), and those of the config and its sub-configs (DBRX's attn_config.attn_pdrop), read in forwards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.testing.reference import silence_dropout

    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    seed = AutoModelForCausalLM.from_config(AutoConfig.for_model("seed_oss", head_dim=8, intermediate_size=64, **sizes))
    dbrx_config = AutoConfig.for_model("dbrx", resid_pdrop=0.2, emb_pdrop=0.1, **sizes)
    dbrx_config.attn_config.attn_pdrop = 0.3
    for model in (seed, torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Dropout2d(0.5))):
        silence_dropout(model)
        assert not [n for m in model.modules() for n, v in vars(m).items() if "drop" in n and v]
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd))
    assert seed.config.residual_dropout == seed.config.attention_dropout == 0

    class Reads(torch.nn.Module):  # a module that reads its config's probabilities in its forward
        def __init__(self, config):
            super().__init__()
            self.config = config

    silence_dropout(Reads(dbrx_config))
    assert dbrx_config.resid_pdrop == dbrx_config.emb_pdrop == dbrx_config.attn_config.attn_pdrop == 0


class Noisy(torch.nn.Module):
    """A module followed by noise drawn in every call: in training mode only (`training_only`), or always."""

    def __init__(self, inner: torch.nn.Module, training_only: bool):
        super().__init__()
        self.inner, self.training_only = inner, training_only

    def forward(self, hidden_states):
        out = self.inner(hidden_states)
        return out + 1e-2 * torch.rand_like(out) if self.training or not self.training_only else out


def with_noisy_final_norm(monkeypatch, training_only: bool) -> None:
    """The debug recipe's model loads with its final norm followed by noise."""
    import finetune.model.loading

    load = finetune.model.loading.load_model

    def noisy(cfg, folder):
        model = load(cfg, folder)
        model.model.norm = Noisy(model.model.norm, training_only)
        return model

    monkeypatch.setattr(finetune.model.loading, "load_model", noisy)


@pytest.mark.e2e
def test_a_forward_random_in_every_call_is_refused_naming_the_module(capsys, monkeypatch):
    """Noise drawn in evaluation mode too: no check can compare one draw with another, so one error line naming the
    module (not a FAIL, which would blame the trainer)."""
    with_noisy_final_norm(monkeypatch, training_only=False)
    code = verify.main([DEBUG])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and errors == [
        "error: finetune.verify: the training forward is random: Noisy (model.norm) gives a different output for the "
        "same input on each call, in evaluation mode too (dropout is off already); the trainer and the brute force "
        "would see different draws, so no step can be checked: remove that draw from the forward to verify this model"
    ], err[-3000:]
    assert "verify: FAIL" not in out and "verify: PASS" not in out


@pytest.mark.e2e
def test_a_module_random_in_training_mode_runs_in_evaluation_mode_for_the_check(capsys, monkeypatch):
    """Noise drawn in training mode only (as PhiMoE's router samples): found by running the first micro-batch twice,
    run in evaluation mode in the trained model and the reference alike, said in one line; the step passes."""
    with_noisy_final_norm(monkeypatch, training_only=True)
    code = verify.main([DEBUG, "train.max_grad_norm=0"])
    out = capsys.readouterr().out
    assert code == 0 and "verify: PASS" in out, out[-3000:]
    assert max(errors_in(out)) <= 1e-5
    assert (
        "verify: Noisy (model.norm) gives a different output for the same input in training mode (a random draw in "
        "its forward); the check runs it in evaluation mode (no draw), in the trained model and the reference alike"
    ) in out.splitlines()


@pytest.mark.parametrize(
    "args",
    [["recipe=recipes/missing.yaml"], [DEBUG, "optim.lrr=1e-4"], [DEBUG, "train.global_batch_size=6"]],
    ids=["missing-recipe", "typo", "indivisible-batch"],
)
def test_recipe_errors_are_the_same_as_training(args, capfd):
    trained = call(capfd, args)
    verified = call(capfd, args, tool="finetune.verify")
    assert trained.returncode == verified.returncode == 2
    assert verified.stderr.startswith("error: ") and verified.stderr == trained.stderr


def test_a_step_is_judged_against_its_floor_unless_a_tolerance_is_given():
    """fp32: 3e-5 passes where the run's own arithmetic is 3.1e-5 off float64 (quickstart's LoRA step), fails where
    it is 1e-6 off, and 7e-5 fails against 3.1e-5 (over FLOOR_FACTOR × the floor); the fixed tolerance stays the
    least; verify.tolerance replaces both."""

    def step(error, floor):
        return verify.StepCheck(1, 8, 100, error, {"model": (error, 1.0)}, weights=[1.0, 1.0], floor=floor)

    fixed = verify.TOLERANCES["fp32"]
    assert verify.FLOOR_FACTOR == 2.0
    assert verify.report([step(3e-5, 3.1e-5)], fixed, None, "fp32", 1)[1] is True
    text, passed = verify.report([step(3e-5, 1e-6)], fixed, None, "fp32", 1)
    assert passed is False and "above tolerance" in text and "(tolerance 1.00e-05)" in text
    assert verify.report([step(7e-5, 3.1e-5)], fixed, None, "fp32", 1)[1] is False
    assert verify.report([step(9e-6, 0.0)], fixed, None, "fp32", 1)[1] is True
    assert verify.report([step(3e-5, 3.1e-5)], fixed, 2e-5, "fp32", 1)[1] is False


def test_verify_arguments_and_tolerances():
    with pytest.raises(RecipeError, match="verify.steps='two' is not a number"):
        verify.split_args([DEBUG, "verify.steps=two"])
    assert verify.split_args([DEBUG, "verify.steps=3", "verify.tolerance=1e-3"]) == ([DEBUG], 3, 1e-3)
    assert verify.tolerance_for(load_config([DEBUG])) == (1e-5, "fp32")
    # the lowest precision the step runs in sets the tolerance: bf16 weights under fp32 "precision" are bf16
    assert verify.tolerance_for(load_config([DEBUG, "model.dtype=bfloat16"]))[1] == "bf16"
    assert group_of("base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight") == "model.layers.3"
    assert group_of("lm_head.weight") == "lm_head"


def verify_passes(argv: list[str]) -> None:
    """One rank of a two-rank `finetune.verify`: it must pass (rank 0 prints the report)."""
    assert verify.main(argv) == 0


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_ranks_check_the_window_gathered_from_both(capfd):
    capfd.readouterr()
    forked_ranks(verify_passes, [DEBUG], ACCELERATE_USE_CPU="true")
    out = capfd.readouterr().out
    # both ranks' rows were gathered: the whole window of 8 sequences, 284 targets, as on one process
    assert "8 sequences, 284 target tokens from 2 ranks" in out, out[-3000:]
    assert max(errors_in(out)) <= 1e-5
    (weights,) = weights_in(out)  # one micro-batch of 4 per rank
    assert len(weights) == 2 and all(w == pytest.approx(1, abs=1e-6) for w in weights)


SHIPPED = {  # each shipped recipe as a user runs `finetune-verify recipe=NAME`: its model, loading and batch
    "debug": [],
    "quickstart": [],
    "qlora": [],
    "qlora, nf4 without double quantization": ["model.quantization.bnb_4bit_use_double_quant=false"],
    "qlora, fp4": ["model.quantization.bnb_4bit_quant_type=fp4"],
    "vlm": [],
    "vlm_qwen": [],
    # as shipped, 1,024 rows of float64 reference per step; 64 keep its model, packing and micro-batch (4 of them)
    "vlm_seed": ["train.global_batch_size=64"],
}


@pytest.mark.slow  # every shipped recipe at its own size: SmolLM2-135M, its 4-bit base and its VLMs
@pytest.mark.e2e
@pytest.mark.parametrize("name", list(SHIPPED))
def test_every_shipped_recipe_passes_at_its_own_size(name, capfd):
    recipe = name.split(",")[0]
    result = call(capfd, [f"recipe=recipes/{recipe}.yaml", *SHIPPED[name]], tool="finetune.verify")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    verdict = re.search(r"^verify: PASS: largest relative error (\S+) \(tolerance (\S+)\)", result.stdout, re.M)
    assert verdict and float(verdict.group(1)) <= float(verdict.group(2)), result.stdout[-3000:]
    assert "silently incorrect" not in result.stderr  # no 4-bit weight went through a kernel without autograd
