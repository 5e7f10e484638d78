"""Models whose layers carry state along the sequence (short convolutions: LFM2; Gated DeltaNet linear attention:
Qwen3.5; Mamba: Bamba, Granite 4 hybrid) are refused packed rows in one line before their weights load, naming the
batching that is exact; their padded rows pass `verify` in the family matrix (tests/test_families.py)."""

import re

import pytest
from transformers import AutoConfig, AutoTokenizer

from finetune.model.sequence_mixers import stateful_mixers
from finetune.testing.families import DEBUG, family_folder
from tests.data_files import smollm2_folder
from tests.launch import call

# one family of each kind of stateful mixer; their tiny configs: finetune/testing/families.py
FAMILIES = ["lfm2", "qwen3_5_text", "bamba"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


@pytest.mark.parametrize("family", FAMILIES)
def test_packing_is_refused_in_one_line_before_the_model_loads(family, tokenizer, tmp_path, capfd):
    folder, out = family_folder(tmp_path, family, tokenizer), tmp_path / "out"
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


def test_the_refusals_way_out_trains_as_written(tokenizer, tmp_path, capfd):
    """The token budget the refusal names, every key with its value, is the one next run: it trains."""
    folder = family_folder(tmp_path, "lfm2", tokenizer)
    model = [*DEBUG, f"model.name_or_path={folder}", "model.gguf_file=null", "train.max_steps=1"]
    refused = call(capfd, [*model, "data.batching=packed", f"train.output_dir={tmp_path / 'refused'}"])
    error = next(line for line in refused.stderr.splitlines() if line.startswith("error:"))
    way = error.rsplit("; set ", 1)[1].split(" or ")[0].split()
    # debug micro-batch 4 × data.max_length 64; global batch 8 × 64
    assert way == ["data.batching=token_budget", "data.max_tokens_per_micro_batch=256", "train.global_batch_tokens=512"]
    trained = call(capfd, [*model, "data.batching=packed", *way, f"train.output_dir={tmp_path / 'out'}"])
    assert trained.returncode == 0 and "error:" not in trained.stderr, trained.stderr[-3000:]


def test_attention_only_models_are_not_refused():
    for family in ("llama", "qwen3", "gemma3_text", "gpt_oss", "qwen3_moe", "mixtral", "deepseek_v3"):
        assert stateful_mixers(AutoConfig.for_model(family)) == [], family
