"""The family matrix: a tiny random model of each decoder family transformers ships (finetune/testing/families.py),
one optimizer step of the debug recipe checked by `finetune.verify` against the float64 brute force, padded and
packed (the default tier), length-grouped, on two CPU ranks, with LoRA and with QLoRA (the slow tier). Every case
passes, mixtures of experts with their router balancing loss on, or (packed rows only) is refused in one line naming
the batching that is exact: a family whose layers carry state along the sequence (linear attention, short
convolutions, Mamba), or whose attention lets a packed row's sequences see one another (gpt-oss).
scripts/family_matrix.py writes the same cases' figures to docs/models.md."""

import re

import pytest
from transformers import AutoTokenizer

from finetune.testing.families import ADAPTERS, FAMILIES, REFUSED, family_folder, two_rank_batching, verify_argv
from finetune.tools import verify
from tests.data_files import smollm2_folder
from tests.launch import forked_ranks


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


@pytest.mark.e2e
@pytest.mark.parametrize("batching", ["padded", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_passes_or_packing_is_refused(family, batching, tokenizer, tmp_path, capsys):
    code = verify.main(verify_argv(family_folder(tmp_path, family, tokenizer), family, batching))
    out, err = capsys.readouterr()
    if (family, batching) in REFUSED:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1, err[-3000:]
        assert re.search(REFUSED[family, batching], errors[0]), errors[0]
    else:
        assert code == 0 and "verify: PASS" in out, (out + err)[-3000:]


@pytest.mark.slow  # 21 more verify runs of 3-6 s: the default tier keeps padded and packed
@pytest.mark.e2e
@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_passes_with_length_grouped_rows(family, tokenizer, tmp_path, capsys):
    code = verify.main(verify_argv(family_folder(tmp_path, family, tokenizer), family, "length_grouped"))
    out, err = capsys.readouterr()
    assert code == 0 and "verify: PASS" in out, (out + err)[-3000:]


@pytest.mark.slow  # 42 more verify runs of about 2 s
@pytest.mark.e2e
@pytest.mark.parametrize("adapter", list(ADAPTERS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_passes_with_lora_and_qlora(family, adapter, tokenizer, tmp_path, capsys):
    """The adapters' gradient against the float64 brute force over the same (dequantized) base."""
    argv = verify_argv(family_folder(tmp_path, family, tokenizer), family, two_rank_batching(family))
    code = verify.main([*argv, *ADAPTERS[adapter]])
    out, err = capsys.readouterr()
    assert code == 0 and "verify: PASS" in out, (out + err)[-3000:]


def verify_passes(argv: list[str]) -> None:
    assert verify.main(argv) == 0


@pytest.mark.slow  # 21 two-rank runs of 6-10 s, each with the cores to itself
@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_passes_on_two_ranks(family, tokenizer, tmp_path, capfd):
    """The window gathered from both ranks (packed rows where the family packs, else padded) against the float64
    brute force: the ranks' counts and, for a mixture of experts, each rank's balancing loss weighed alike."""
    argv = verify_argv(family_folder(tmp_path, family, tokenizer), family, two_rank_batching(family))
    capfd.readouterr()
    forked_ranks(verify_passes, argv, ACCELERATE_USE_CPU="true")
    out = capfd.readouterr().out
    assert "from 2 ranks" in out and "verify: PASS" in out, out[-3000:]


def test_all_linear_lora_leaves_out_linear_layers_that_return_no_tensor():
    """PhiMoE's router is a torch Linear by class that returns its routing (a tuple): peft's all-linear would wrap it
    and its LoRA layer fail on the tuple; it is left out, every other linear layer adapted, and the forward runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.freeze import add_lora, not_linear_outputs
    from finetune.recipe import load_config

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    sizes.update(num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("phimoe", **sizes, **FAMILIES["phimoe"]))
    routers = [f"model.layers.{i}.mlp.router" for i in range(2)]
    assert not_linear_outputs(model) == routers
    assert not_linear_outputs(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **sizes))) == []
    cfg = load_config(["recipe=recipes/debug.yaml", "model.lora.enabled=true", "model.lora.target_modules=all-linear"])
    adapted = add_lora(model, cfg.model)
    names = [n.removeprefix("base_model.model.") for n, _ in adapted.named_modules()]
    wrapped = {n.removesuffix(".lora_A") for n in names if n.endswith(".lora_A")}
    assert "model.layers.0.self_attn.q_proj" in wrapped and not set(routers) & wrapped
    assert adapted(input_ids=torch.randint(0, 64, (1, 8))).logits.shape == (1, 8, 64)
