"""Models whose layers carry state along the sequence (short convolutions: LFM2; Gated DeltaNet linear attention:
Qwen3.5; Mamba: Bamba, Granite 4 hybrid) are refused packed rows in one line before their weights load, naming the
batching that is exact; padded rows pass `verify` against the float64 brute force, one sequence at a time."""

import re

import pytest
from transformers import AutoConfig

from finetune.model.sequence_mixers import stateful_mixers
from finetune.tools import verify
from tests.data_files import smollm2_folder
from tests.launch import call

# each family's config at the debug recipe's size (its config_overrides apply on top: hidden 64, 2 layers, 4 heads)
FAMILIES = {
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1], block_ff_dim=128, conv_L_cache=3),
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        head_dim=16,
    ),
    "bamba": dict(
        layers_block_type=None,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=32,  # mamba_expand 2 × hidden 64 = heads × head size
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=16,
    ),
}
DEBUG = ["recipe=recipes/debug.yaml", "data.limit=16", "data.max_length=64", "log.wandb_mode=disabled"]


def family_folder(tmp_path, family: str):
    """The family's tiny config and SmolLM2's tokenizer in a folder, as a hub model's is (the debug recipe builds the
    model from its config: model.from_config)."""
    from transformers import AutoTokenizer

    folder = tmp_path / family
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    extra = {k: v for k, v in FAMILIES[family].items() if v is not None}
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packing_is_refused_in_one_line_before_the_model_loads(family, tmp_path, capfd):
    folder, out = family_folder(tmp_path, family), tmp_path / "out"
    assert stateful_mixers(AutoConfig.from_pretrained(folder))
    result = call(
        capfd,
        [
            *DEBUG,
            f"model.name_or_path={folder}",
            "model.gguf_file=null",
            "data.batching=packed",
            f"train.output_dir={out}",
        ],
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert re.search(
        r"data\.batching=packed would carry the state of its .+ layers .* set data\.batching=token_budget", errors[0]
    ), errors[0]
    assert "parameters:" not in result.stdout and not out.exists()  # refused before the weights


@pytest.mark.e2e
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_rows_pass_verify(family, tmp_path, capsys):
    folder = family_folder(tmp_path, family)
    code = verify.main([*DEBUG, f"model.name_or_path={folder}", "model.gguf_file=null", "data.batching=padded"])
    out = capsys.readouterr().out
    assert code == 0 and "verify: PASS" in out, out[-3000:]


def test_attention_only_models_are_not_refused():
    for family in ("llama", "qwen3", "gemma3_text", "gpt_oss", "qwen3_moe", "mixtral", "deepseek_v3"):
        assert stateful_mixers(AutoConfig.for_model(family)) == [], family
