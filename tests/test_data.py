"""SFT data: sources, row formats, chat-template label spans, truncation, bad rows, the built-in stdlib_docs set."""

import json
import statistics

import pytest
from transformers import AutoTokenizer

from finetune.data import stdlib_docs
from finetune.data.report import DataReport
from finetune.data.text import load_sft_dataset
from finetune.recipe import DataConfig, RecipeError
from tests.data_files import chat, labelled, smollm2_folder, write_jsonl

EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


def load(tok, source, **kw):
    return load_sft_dataset(DataConfig(source=str(source), **kw), tok)


# ---- chat rows and label spans ----


def test_messages_label_only_the_assistant_content_and_end_of_turn(tok, tmp_path):
    answer = "Paris is the capital of France.\nIt is on the Seine."
    ds, report = load(tok, write_jsonl(tmp_path / "a.jsonl", [chat("Capital of France?", answer)]))
    row = ds[0]
    assert labelled(tok, row) == answer + EOT
    assert len(row["labels"]) == len(row["input_ids"])
    assert all(t == -100 or t == i for t, i in zip(row["labels"], row["input_ids"]))  # not shifted
    rendered = tok.apply_chat_template(chat("Capital of France?", answer)["messages"], tokenize=False)
    assert row["input_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    first = next(k for k, t in enumerate(row["labels"]) if t != -100)
    assert tok.decode(row["input_ids"][:first]).endswith("<|im_start|>assistant\n")
    assert (report.rows_read, report.rows_kept, report.format) == (1, 1, "messages")
    assert report.target_tokens == sum(t != -100 for t in row["labels"][1:]) and "1 of 1 rows kept" in report.summary()


def test_multi_turn_labels_both_assistant_turns_and_completion_only_the_last(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [chat("One?", "First answer.", "Two?", "Second answer.")])
    ds, _ = load(tok, path)
    assert labelled(tok, ds[0]) == f"First answer.{EOT}Second answer.{EOT}"
    spans, inside = [], False  # the labelled runs, decoded one by one
    for t in ds[0]["labels"]:
        if t != -100:
            spans[-1:] = [spans[-1] + [t]] if inside else [*spans[-1:], [t]]
        inside = t != -100
    assert [tok.decode(s) for s in spans] == [f"First answer.{EOT}", f"Second answer.{EOT}"]
    ds, _ = load(tok, path, loss_on="completion")
    assert labelled(tok, ds[0]) == f"Second answer.{EOT}"
    ds, _ = load(tok, path, loss_on="all")
    assert ds[0]["labels"] == ds[0]["input_ids"]


def test_prompt_completion_and_text_formats(tok, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    ds, report = load(tok, path)
    assert report.format == "prompt_completion" and labelled(tok, ds[0]) == "4" + EOT
    assert "<|im_start|>user\n2+2?<|im_end|>" in tok.decode(ds[0]["input_ids"])
    ds_completion, _ = load(tok, path, loss_on="completion")
    assert ds_completion[0] == ds[0]
    ds, _ = load(tok, path, loss_on="all")
    assert ds[0]["labels"] == ds[0]["input_ids"]
    # conversational prompt/completion: the prompt's assistant turn is never a target
    conv = {"prompt": chat("a?", "A.", "b?")["messages"], "completion": [{"role": "assistant", "content": "B."}]}
    ds, _ = load(tok, write_jsonl(tmp_path / "conv.jsonl", [conv]))
    assert labelled(tok, ds[0]) == "B." + EOT

    ds, report = load(tok, write_jsonl(tmp_path / "t.jsonl", [{"text": "def f(x):\n    return x"}]), loss_on="all")
    assert report.format == "text"
    # a text row ends with the tokenizer's EOS, trained on, so the model learns to stop (data.text_eos)
    written = tok("def f(x):\n    return x")["input_ids"]
    assert tok.eos_token_id is not None and written[-1] != tok.eos_token_id
    assert ds[0]["input_ids"] == written + [tok.eos_token_id] == ds[0]["labels"]
    ds, _ = load(tok, tmp_path / "t.jsonl", format="text")  # loss_on does not apply to plain text
    assert ds[0]["labels"] == ds[0]["input_ids"]
    ds, _ = load(tok, tmp_path / "t.jsonl", text_eos=False)  # the row as written
    assert ds[0]["input_ids"] == written == ds[0]["labels"]


def test_explicit_format_and_missing_columns_name_what_was_found(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}])
    expected = r"expected messages; conversations \(sharegpt\); instruction \+ output \(alpaca\); prompt \+ completion"
    with pytest.raises(RecipeError, match=r"columns found: question, answer; " + expected):
        load(tok, path)
    with pytest.raises(RecipeError, match=r"columns found: question, answer; expected text \(data.format=text\)"):
        load(tok, path, format="text")
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"text": "fine"}, {"txt": "typo"}])
    with pytest.raises(RecipeError, match=r"m.jsonl line 2: missing text \(row has: txt\)"):
        load(tok, mixed)


# ---- length ----


def test_truncation_right_drop_error_with_counts(tok, tmp_path):
    long_answer = " ".join(["word"] * 80)
    path = write_jsonl(tmp_path / "a.jsonl", [chat("short?", "Yes."), chat("long?", long_answer)])
    short_len = len(load(tok, path)[0][0]["input_ids"])
    ds, report = load(tok, path, max_length=short_len + 5)
    assert [len(r) for r in ds["input_ids"]] == [short_len, short_len + 5] and report.truncated == 1
    assert labelled(tok, ds[1]).startswith("word word") and EOT not in labelled(tok, ds[1])
    ds, report = load(tok, path, max_length=short_len + 5, truncation="drop")
    assert len(ds) == 1 and (report.dropped_over_length, report.rows_read, report.rows_kept) == (1, 2, 1)
    assert "1 dropped over data.max_length" in report.summary()
    with pytest.raises(RecipeError, match=rf"a.jsonl line 2: \d+ tokens, longer than data.max_length={short_len + 5}"):
        load(tok, path, max_length=short_len + 5, truncation="error")


def test_rows_without_targets_are_dropped_and_counted(tok, tmp_path):
    only_user = {"messages": [{"role": "user", "content": "hello?"}]}
    ds, report = load(tok, write_jsonl(tmp_path / "a.jsonl", [only_user, chat("q?", "The answer.")]))
    assert len(ds) == 1 and report.dropped_no_supervised_tokens == 1
    # truncation that cuts off the whole answer leaves no target either
    messages = chat("q?", "The answer.")["messages"]
    prefix_len = len(tok.apply_chat_template(messages[:1], add_generation_prompt=True)["input_ids"])
    path = write_jsonl(tmp_path / "b.jsonl", [chat("q?", "The answer."), chat("A much longer question?", "Yes.")])
    ds, report = load(tok, path, max_length=prefix_len + 1)
    assert len(ds) == 1 and report.truncated == 2 and report.dropped_no_supervised_tokens == 1
    assert labelled(tok, ds[0]) == "The"
    # a one-token text row has no target after the shift (as written); with its EOS the EOS is its target
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}, {"text": "a b c"}])
    ds, report = load(tok, path, text_eos=False)
    assert len(tok("a")["input_ids"]) == 1 and len(ds) == 1 and report.dropped_no_supervised_tokens == 1
    ds, report = load(tok, path)
    assert len(ds) == 2 and ds[0]["labels"] == tok("a")["input_ids"] + [tok.eos_token_id]


# ---- bad rows and sources ----


def test_malformed_json_line_names_file_and_line_or_is_skipped(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat("a?", "A."), '{"messages": [', "", chat("b?", "B.")])
    with pytest.raises(RecipeError, match=r"bad.jsonl line 2: not valid JSON"):
        load(tok, path)
    ds, report = load(tok, path, on_bad_row="skip")
    assert len(ds) == 2 and report.bad_rows_skipped == 1 and report.rows_read == 3
    ds, report = load(tok, path, on_bad_row="skip", limit=2)  # limit counts raw rows, bad ones included
    assert len(ds) == 1 and report.rows_read == 2


def test_empty_content_is_a_bad_row(tok, tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [chat("a?", "A."), chat("b?", "  "), {"text": ""}])
    with pytest.raises(RecipeError, match=r"e.jsonl line 2: messages\[1\].content is empty"):
        load(tok, path)
    ds, report = load(tok, path, on_bad_row="skip")
    assert len(ds) == 1 and report.bad_rows_skipped == 2
    with pytest.raises(RecipeError, match=r"t.jsonl line 1: text is empty"):
        load(tok, write_jsonl(tmp_path / "t.jsonl", [{"text": ""}]))


def test_a_template_that_renders_earlier_turns_differently_is_labelled_as_it_renders_them(tok, tmp_path):
    other = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    other.chat_template = (  # renders a turn differently once it is no longer the last one (as Qwen3, gpt-oss do)
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if not loop.last %} (earlier){% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    path = write_jsonl(tmp_path / "a.jsonl", [chat("a?", "A.", "b?", "B.")])
    ds, _ = load(other, path)
    # each turn's tokens as the whole conversation shows them, to the token that ends it
    assert labelled(other, ds[0]) == "A. (earlier)<|im_end|>B.<|im_end|>"
    text = other.decode(ds[0]["input_ids"])
    assert text.count(" (earlier)") == 3 and text.endswith("B.<|im_end|>\n")
    ds, _ = load(other, path, loss_on="all")  # no spans needed
    assert len(ds) == 1


def test_missing_paths_unsupported_files_and_unreachable_hub_ids(tok, tmp_path):
    for source in (tmp_path / "nope.jsonl", "some/dir/train", "./x"):
        with pytest.raises(RecipeError, match=rf"data.source={source}: no such file or folder"):
            load(tok, source)
    (tmp_path / "a.txt").write_text("hi")
    with pytest.raises(RecipeError, match="unsupported file type"):
        load(tok, tmp_path / "a.txt")
    with pytest.raises(RecipeError, match="no .* files"):
        load(tok, tmp_path)
    with pytest.raises(RecipeError, match="neither a local path nor a reachable hub dataset"):
        load(tok, "someone-offline/no-such-dataset")


def test_parquet_csv_json_array_and_folders(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "set"
    folder.mkdir()
    rows = [chat("a?", "A."), chat("b?", "B.")]
    pq.write_table(pa.Table.from_pylist(rows), folder / "part-0.parquet")
    ds, report = load(tok, folder / "part-0.parquet")
    assert [labelled(tok, r) for r in ds] == ["A." + EOT, "B." + EOT] and report.format == "messages"
    (folder / "part-1.csv").write_text('prompt,completion\n"c?","C."\n"d?",\n')
    with pytest.raises(RecipeError, match=r"part-1.csv row 2: completion is empty"):
        load(tok, folder / "part-1.csv")
    (tmp_path / "arr.json").write_text(json.dumps([chat("e?", "E.")]))
    ds, _ = load(tok, tmp_path / "arr.json")
    assert labelled(tok, ds[0]) == "E." + EOT
    (folder / "part-1.csv").write_text('prompt,completion\n"c?","C."\n')
    (folder / ".hidden.jsonl").write_text("not json\n")
    with pytest.raises(RecipeError, match=r"part-1.csv row 1: missing messages"):  # auto: messages is found first
        load(tok, folder)
    ds, report = load(tok, folder, on_bad_row="skip")
    assert report.rows_read == 3 and report.bad_rows_skipped == 1 and len(ds) == 2  # the csv row lacks messages
    ds, report = load(tok, folder, format="prompt_completion", on_bad_row="skip", limit=3)
    assert [labelled(tok, r) for r in ds] == ["C." + EOT]


# ---- stdlib_docs ----


def test_stdlib_docs_builds_deterministically_caches_and_spans_lengths(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    ds, report = load(tok, "stdlib_docs", max_length=1024)
    cached = stdlib_docs.cache_path()
    assert cached.is_file() and cached.parent == tmp_path / "data" and not list(cached.parent.glob(".*"))
    assert 1500 <= report.rows_read <= 2200 and report.rows_kept == report.rows_read
    lengths = [len(ids) for ids in ds["input_ids"]]
    assert 30 <= min(lengths) <= 60 and 60 <= statistics.median(lengths) <= 90 and max(lengths) == 1024
    assert report.truncated >= 1
    first = json.loads(cached.read_text().splitlines()[0])["messages"]
    assert first[0]["content"].startswith("What ") and first[1]["content"]
    questions = [r["messages"][0]["content"] for r in stdlib_docs.build_rows()]
    assert questions == [r["messages"][0]["content"] for r in stdlib_docs.build_rows()]
    modules = [q.split("`")[1].split(".")[0] for q in questions]
    assert "What does `json.dumps` do?" in questions and modules == sorted(modules)
    again, _ = load(tok, "stdlib_docs", max_length=1024)  # from the cache
    assert again["input_ids"] == ds["input_ids"] and again["labels"] == ds["labels"]
    assert isinstance(report, DataReport) and report.summary().startswith("stdlib_docs (messages): ")


def test_the_chat_templates_default_system_prompt_applies_unless_the_recipe_gives_one(tok, tmp_path):
    """SmolLM2's template adds its default system prompt to a conversation without one (prompt/completion strings
    too); data.system_prompt replaces it for such rows, a row's own system turn is kept, and the labels stay."""
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    default = tok.decode(load(tok, path)[0][0]["input_ids"])
    assert "<|im_start|>system\nYou are a helpful AI assistant named SmolLM" in default
    ds, _ = load(tok, path, system_prompt="Answer with a number.")
    text = tok.decode(ds[0]["input_ids"])
    assert "<|im_start|>system\nAnswer with a number.<|im_end|>" in text and "SmolLM" not in text
    assert labelled(tok, ds[0]) == "4" + EOT
    own = {"messages": [{"role": "system", "content": "Be terse."}, *chat("2+2?", "4")["messages"]]}
    ds, _ = load(tok, write_jsonl(tmp_path / "own.jsonl", [own]), system_prompt="Answer with a number.")
    assert "Be terse." in tok.decode(ds[0]["input_ids"]) and "Answer with a number." not in tok.decode(
        ds[0]["input_ids"]
    )
