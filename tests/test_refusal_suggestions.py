"""A refusal's way out runs as written: each refusal that the recipe, its plan, the model's config or the launch can
raise before any weight loads is triggered, the `key=value` overrides its last clause names are applied (each
alternative alone), and the recipe then builds its plan and passes the same check. In-process, no model loaded."""

import re
from pathlib import Path

import pytest
from transformers import AutoConfig, Gemma3Config

from finetune.model.image_rows import check_packing
from finetune.model.sequence_mixers import check_packed_mixers
from finetune.recipe import RecipeError, load_config, resolve_plan
from finetune.recipe.checks import precision_on_device
from finetune.training.distributed import check_launch

ROOT = Path(__file__).resolve().parents[1]
DEBUG = [f"recipe={ROOT / 'recipes' / 'debug.yaml'}"]  # micro 4, global 8, data.max_length 128
STREAM = ["data.streaming=true", "train.max_steps=3"]
KEY_VALUE = re.compile(r"(?<![\w.])([a-z_]+(?:\.[a-z0-9_]+)+)=([^\s,;()]+)")


def ways_out(message: str) -> list[list[str]]:
    """The alternatives a refusal offers (its clause after the last '; ': what is wrong; what to do), split at 'or',
    each as the key=value overrides it names together; an alternative that names none (remove a key) is left out."""
    if "; " not in message:
        return []
    clause = message.rsplit("; ", 1)[-1]
    groups = [[f"{k}={v}" for k, v in KEY_VALUE.findall(part)] for part in re.split(r"\bor\b", clause)]
    return [group for group in groups if group]


def planned(argv):
    cfg = load_config([*DEBUG, *argv])
    return cfg, resolve_plan(cfg, 1)


def config_and_plan(argv):
    planned(argv)


def mixer_model(argv):  # LFM2's short convolutions carry state along a row (finetune/model/sequence_mixers.py)
    cfg, plan = planned(argv)
    check_packed_mixers(cfg.model, plan, AutoConfig.for_model("lfm2"))


def image_model(argv):  # Gemma 3's image blocks attend both ways (finetune/model/image_rows.py)
    cfg, plan = planned(argv)
    check_packing(cfg.model, plan, Gemma3Config())


def device(gpu, bf16):
    def check(argv):
        cfg, _ = planned(argv)
        if problem := precision_on_device(cfg.train, cfg.model, gpu, bf16):
            raise RecipeError(problem)

    return check


def launch(env):
    def check(argv):
        cfg, plan = planned(argv)
        check_launch(cfg.train, cfg.optim, cfg.data, plan, env)

    return check


CASES = {
    "packed, stateful layers": (mixer_model, ["data.batching=packed"]),
    "packed train and eval, stateful layers": (mixer_model, ["data.batching=packed", "eval.fraction=0.1"]),
    "packed eval, stateful layers": (mixer_model, ["eval.fraction=0.1"]),
    "packed to a budget, stateful layers": (
        mixer_model,
        ["data.batching=packed", "data.max_tokens_per_micro_batch=256", "train.global_batch_tokens=1024"],
    ),
    "packed eval to a budget, stateful layers": (
        mixer_model,
        ["data.batching=packed", "eval.fraction=0.1", "eval.max_tokens_per_micro_batch=256"],
    ),
    "packed with lr scaling, stateful layers": (
        mixer_model,
        ["data.batching=packed", "optim.lr_scaling=sqrt", "optim.base_batch_size=4"],
    ),
    "packed stream, stateful layers": (mixer_model, ["data.batching=packed", *STREAM]),
    "packed image rows": (image_model, ["data.batching=packed"]),
    "token_budget without a budget": (config_and_plan, ["data.batching=token_budget"]),
    "token budget without global_batch_tokens": (
        config_and_plan,
        ["data.batching=token_budget", "data.max_tokens_per_micro_batch=512"],
    ),
    "global_batch_tokens not divisible": (
        config_and_plan,
        ["data.batching=token_budget", "data.max_tokens_per_micro_batch=512", "train.global_batch_tokens=5000"],
    ),
    "eval token_budget without a budget": (config_and_plan, ["eval.fraction=0.2", "eval.batching=token_budget"]),
    "global batch not divisible": (config_and_plan, ["train.global_batch_size=10"]),
    "quantized base without LoRA": (config_and_plan, ["model.quantization.bits=4"]),
    "merge into a quantized base": (
        config_and_plan,
        ["model.quantization.bits=4", "model.lora.enabled=true", "model.lora.merge=true"],
    ),
    "fp16 with bf16 weights": (config_and_plan, ["train.precision=fp16", "model.dtype=bfloat16"]),
    "LoRA keys without LoRA": (config_and_plan, ["model.lora.r=16"]),
    "length_grouped stream": (config_and_plan, ["data.batching=length_grouped", *STREAM]),
    "token_budget stream": (
        config_and_plan,
        [
            "data.batching=token_budget",
            "data.max_tokens_per_micro_batch=512",
            "train.global_batch_tokens=1024",
            *STREAM,
        ],
    ),
    "held-out rows of a stream": (config_and_plan, ["eval.fraction=0.1", *STREAM]),
    "mixture stream": (config_and_plan, ["data.mixture=[{source: stdlib_docs}]", *STREAM]),
    "lr scaling without a base batch": (config_and_plan, ["optim.lr_scaling=linear"]),
    "auto micro-batch of a stream": (config_and_plan, ["train.micro_batch_size=auto", *STREAM]),
    "fp16 on a CPU": (device(None, False), ["train.precision=fp16"]),
    "bf16 on a V100": (device("Tesla V100-SXM2-16GB", False), ["train.precision=bf16"]),
    "bf16 weights on a T4": (device("Tesla T4", False), ["train.precision=bf16", "model.dtype=bfloat16"]),
    "launched in bf16, recipe in fp32": (launch({"ACCELERATE_MIXED_PRECISION": "bf16"}), ["train.precision=fp32"]),
}


@pytest.mark.parametrize("case", CASES)
def test_each_way_out_of_a_refusal_runs_as_written(case):
    check, argv = CASES[case]
    with pytest.raises(RecipeError) as refused:
        check(argv)
    ways = ways_out(str(refused.value))
    assert ways, f"no key=value way out in: {refused.value}"
    for way in ways:
        try:
            check([*argv, *way])
        except RecipeError as still:
            pytest.fail(f"{' '.join(way)} (from: {refused.value}) is refused: {still}")


def test_packed_refusal_names_each_key_a_token_budget_needs_with_values_from_the_plan():
    with pytest.raises(RecipeError) as refused:
        mixer_model(["data.batching=packed", "eval.fraction=0.1"])
    # micro 4 × max_length 128 = 512 tokens per micro-batch; global 8 sequences × 128 = 1024 tokens; eval micro 8 × 128
    assert str(refused.value).endswith(
        "; set data.batching=token_budget data.max_tokens_per_micro_batch=512 train.global_batch_tokens=1024 "
        "eval.batching=token_budget eval.max_tokens_per_micro_batch=1024 or data.batching=padded eval.batching=padded "
        "(token_budget: rows of similar length batched to a budget, most of packing's speed, each row alone)"
    ), refused.value
    before, after = planned(["data.batching=packed"])[1], planned(ways_out(str(refused.value))[0])[1]
    assert (after.accumulation, after.global_batch, after.batch_unit) == (before.accumulation, 1024, "tokens")


def test_lr_scaling_keeps_the_peak_lr_when_packing_becomes_a_token_budget():
    argv = ["data.batching=packed", "optim.lr_scaling=sqrt", "optim.base_batch_size=4"]
    with pytest.raises(RecipeError) as refused:
        mixer_model(argv)
    way = ways_out(str(refused.value))[0]
    assert "optim.base_batch_size=512" in way
    assert planned([*argv, *way])[1].peak_lr == pytest.approx(planned(argv)[1].peak_lr)
