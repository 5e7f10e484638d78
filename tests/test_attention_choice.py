"""model.attn_implementation=auto (the default) takes what the model supports: sdpa where it can (no extra line), else
eager, which the start-up line says (gpt-oss: attention sinks, no sdpa); an explicit implementation the model lacks is
one error line, exit 2, nothing written. Packed rows under an attention other than sdpa are probed against their
sequences run alone: gpt-oss builds its masks without the position_ids, so its packed rows would attend across
sequences, and packing it is one error line; a Llama on eager packs exactly."""

from transformers import AutoTokenizer

from finetune.testing.families import family_folder
from finetune.tools import verify
from tests.data_files import smollm2_folder
from tests.launch import call

DEBUG = ["recipe=recipes/debug.yaml", "data.limit=16", "data.max_length=64", "log.wandb_mode=disabled"]
# the way out of refused packing, every key with its value: micro-batch 4 × data.max_length 64, global batch 8 × 64
WAY_OUT = (
    "set data.batching=token_budget data.max_tokens_per_micro_batch=256 train.global_batch_tokens=512 or "
    "data.batching=padded (token_budget: rows of similar length batched to a budget, most of packing's speed, each "
    "row alone)"
)


def gpt_oss_folder(tmp_path):
    """gpt-oss's tiny config of the family matrix and SmolLM2's tokenizer (the debug recipe builds the model)."""
    return family_folder(tmp_path, "gpt_oss", AutoTokenizer.from_pretrained(str(smollm2_folder())))


def test_auto_takes_eager_for_a_model_without_sdpa_and_says_so(tmp_path, capfd):
    model = [f"model.name_or_path={gpt_oss_folder(tmp_path)}", "model.gguf_file=null", "data.batching=padded"]
    result = call(capfd, [*DEBUG, *model, "train.max_steps=1", f"train.output_dir={tmp_path / 'out'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("attention:")]
    assert lines == ["attention: eager (model.attn_implementation=auto: GptOssForCausalLM has no sdpa attention)"]

    out = tmp_path / "asked"
    refused = call(capfd, [*DEBUG, *model, "model.attn_implementation=sdpa", f"train.output_dir={out}"])
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
    assert "model.attn_implementation" in errors[0] and not any(out.rglob("*.safetensors"))


def test_auto_keeps_sdpa_where_the_model_has_it_without_a_line(tmp_path, capfd):
    result = call(capfd, [*DEBUG, "data.batching=padded", "train.max_steps=1", f"train.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in result.stdout.splitlines() if line.startswith("attention:")]


def test_packed_rows_whose_attention_crosses_sequences_are_refused_and_eager_llama_packs(tmp_path, capfd):
    model = [f"model.name_or_path={gpt_oss_folder(tmp_path)}", "model.gguf_file=null", "data.batching=packed"]
    out = tmp_path / "out"
    refused = call(capfd, [*DEBUG, *model, "train.max_steps=1", f"train.output_dir={out}"])
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
    assert errors[0].startswith(
        "error: packed rows (data.batching or eval.batching=packed): GptOssForCausalLM with attention eager does not "
        "keep the sequences of a packed row apart: a packed probe row's logits differ from its sequences' run alone by "
    ) and errors[0].endswith(f"(they attend to one another); {WAY_OUT}"), errors[0]
    assert not any(out.rglob("*.safetensors"))
    eager = call(
        capfd,
        [
            *DEBUG,
            "data.batching=packed",
            "model.attn_implementation=eager",
            "train.max_steps=1",
            f"train.output_dir={tmp_path / 'llama'}",
        ],
    )
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert "attention: eager (per-sequence packed attention replaces sdpa only)" in eager.stdout


def test_packed_rows_an_attention_cannot_run_are_refused_in_one_line(tmp_path, capsys):
    """DeepSeek-V3's latent attention with fewer key/value heads than heads (a config its checkpoints never ship):
    transformers' sdpa path fails on a packed row's mask; the packed probe finds it before training, one line."""
    folder = family_folder(tmp_path, "deepseek_v3", AutoTokenizer.from_pretrained(str(smollm2_folder())))
    code = verify.main([*DEBUG, f"model.name_or_path={folder}", "model.gguf_file=null", "data.batching=packed"])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith(
        "error: packed rows (data.batching or eval.batching=packed): DeepseekV3ForCausalLM with attention sdpa does "
        "not keep the sequences of a packed row apart: the packed probe row cannot run (RuntimeError: "
    ) and errors[0].endswith(WAY_OUT), errors[0]
