"""data.streaming: rows read one at a time are exactly the rows the in-memory path builds; errors stay clear."""

import json

import pytest
from transformers import AutoTokenizer

from finetune.data.streaming import SHUFFLE_BUFFER, stream_sft_dataset
from finetune.data.text import load_sft_dataset
from finetune.recipe import DataConfig, RecipeError, load_config
from tests.data_files import chat, smollm2_folder, write_jsonl
from tests.launch import call


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


def rows_of(dataset):
    return sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in dataset)


def test_streamed_rows_equal_the_in_memory_rows(tok, tmp_path):
    rows = [chat(f"q{k}?", "answer " * (k % 20 + 1)) for k in range(40)]
    rows += [{"messages": [{"role": "user", "content": "x"}]}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    data = DataConfig(source=str(path), max_length=50)
    memory, report = load_sft_dataset(data, tok)
    streamed, streamed_report = stream_sft_dataset(data, tok, seed=3)
    assert rows_of(streamed) == rows_of(memory)
    assert streamed.report.truncated == report.truncated > 0
    assert streamed.report.dropped_no_supervised_tokens == report.dropped_no_supervised_tokens == 1
    assert "streamed" in streamed_report.summary() and streamed_report.format == "messages"
    # a buffered random order, the same for the same (seed, epoch), another for the next epoch
    first, again = [r["input_ids"] for r in streamed], [r["input_ids"] for r in streamed]
    assert first == again and first != [r["input_ids"] for r in memory]
    streamed.set_epoch(1)
    assert [r["input_ids"] for r in streamed] != first
    assert SHUFFLE_BUFFER > 41


def test_parquet_csv_and_folders_stream_too(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "set"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([chat("a?", "A."), chat("b?", "B.")]), folder / "p.parquet")
    (tmp_path / "pc.csv").write_text('prompt,completion\n"c?","C."\n"d?","D."\n')
    for source, fmt in ((folder, "messages"), (tmp_path / "pc.csv", "prompt_completion")):
        data = DataConfig(source=str(source))
        streamed, report = stream_sft_dataset(data, tok)
        assert report.format == fmt
        assert rows_of(streamed) == rows_of(load_sft_dataset(data, tok)[0])


def test_bad_lines_limit_and_arrays(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat("a?", "A."), '{"messages": [', chat("b?", "B.")])
    with pytest.raises(RecipeError, match=r"bad.jsonl line 2: not valid JSON"):  # the first rows are read at start
        stream_sft_dataset(DataConfig(source=str(path)), tok)
    streamed, _ = stream_sft_dataset(DataConfig(source=str(path), on_bad_row="skip"), tok)
    assert len(list(streamed)) == 2 and streamed.report.bad_rows_skipped == 1
    streamed, _ = stream_sft_dataset(DataConfig(source=str(path), limit=1), tok)
    assert len(list(streamed)) == 1
    (tmp_path / "arr.json").write_text(json.dumps([chat("e?", "E.")]))
    with pytest.raises(RecipeError, match="a JSON array cannot be streamed"):
        stream_sft_dataset(DataConfig(source=str(tmp_path / "arr.json")), tok)


def test_streaming_needs_max_steps_and_a_length_free_batching():
    base = ["recipe=recipes/debug.yaml", "data.streaming=true"]
    with pytest.raises(RecipeError, match="set train.max_steps"):
        load_config([*base, "train.max_steps=-1"])
    with pytest.raises(RecipeError, match="data.batching=length_grouped sorts or budgets"):
        load_config([*base, "data.batching=length_grouped"])
    load_config([*base, "data.batching=packed"])


@pytest.mark.e2e
def test_streaming_recipe_trains_end_to_end(tmp_path, capfd):
    out = tmp_path / "s"
    result = call(
        capfd, ["recipe=recipes/debug.yaml", "data.streaming=true", "train.max_steps=2", f"train.output_dir={out}"]
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "streamed" in result.stdout
    steps = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "grad_norm" in e]
    assert len(steps) == 2 and all(e["window_label_tokens"] > 0 for e in steps)
