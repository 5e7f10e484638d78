"""Bad data: rows that would train on something else in silence (a misspelt role, turns out of order, a key twice,
a number that was text) and files that would be skipped in silence (compressed, dangling, unreadable) are named, one
row or file at a time; rows too long to tokenize whole are cut first. In memory and streamed alike, and through the CLI
where the behaviour is the CLI's (a DataLoader worker, the memory of a huge row)."""

import gzip
import json
import os
import re
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.data.streaming import stream_sft_dataset
from finetune.data.text import char_limit, load_sft_dataset
from finetune.recipe import DataConfig, RecipeError
from tests.data_files import chat, labelled, smollm2_folder, write_jsonl
from tests.launch import ROOT, assert_one_error, call

DEBUG = str(ROOT / "recipes" / "debug.yaml")
GOOD = [chat(f"q{k}?", f"answer {k}.") for k in range(4)]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


def turns(*pairs) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


def load(tok, source, **kw):
    return load_sft_dataset(DataConfig(source=str(source), **kw), tok)


def streamed(tok, source, **kw):
    dataset, _ = stream_sft_dataset(DataConfig(source=str(source), **kw), tok)
    return list(dataset.rows())


# ---- rows ----


ROWS = [
    (
        "role misspelt",
        turns(("user", "q"), ("assitant", "a")),
        r"messages\[1\]\.role='assitant' is not a chat role \(system, user, assistant\); did you mean 'assistant'\?",
    ),
    ("role unknown", turns(("user", "q"), ("bot", "a")), r"messages\[1\]\.role='bot' is not a chat role"),
    (
        "tool role, template without tools",
        turns(("user", "q"), ("tool", "r"), ("assistant", "a")),
        r"messages\[1\]\.role='tool' is not a chat role",
    ),
    (
        "two user turns",
        turns(("user", "q"), ("user", "q2"), ("assistant", "a")),
        r"messages\[1\] is a second user turn in a row; turns alternate user, assistant, user, … \(merge the two\)",
    ),
    (
        "two assistant turns",
        turns(("user", "q"), ("assistant", "a"), ("assistant", "b")),
        r"messages\[2\] is a second assistant turn in a row",
    ),
    (
        "assistant first",
        turns(("assistant", "a"), ("user", "q"), ("assistant", "b")),
        r"messages\[0\] is an assistant turn before any user turn; a conversation starts with a user turn",
    ),
    (
        "assistant after system",
        turns(("system", "s"), ("assistant", "a")),
        r"messages\[1\] is an assistant turn before",
    ),
    (
        "system in the middle",
        turns(("user", "q"), ("system", "s"), ("assistant", "a")),
        r"messages\[1\] is a system turn after the first turn; a system turn can only come first",
    ),
    (
        "a key twice",
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], '
        '"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}',
        r"key 'messages' appears twice in one object \(JSON would keep only the last\); remove one",
    ),
    (
        "a key twice in a message",
        '{"messages": [{"role": "user", "content": "a", "content": "z"}, {"role": "assistant", "content": "b"}]}',
        r"key 'content' appears twice",
    ),
    (
        "lone surrogate in content",
        '{"messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", "content": "c"}]}',
        r"messages\[0\]\.content holds a lone surrogate \('\\ud800' at character 2\), which is not text",
    ),
    (
        "lone surrogate in a role",
        '{"messages": [{"role": "us\\udc80er", "content": "a"}, {"role": "assistant", "content": "c"}]}',
        r"messages\[0\]\.role holds a lone surrogate",
    ),
]


@pytest.mark.parametrize("name, row, message", ROWS, ids=[r[0] for r in ROWS])
def test_a_row_that_would_train_on_something_else_is_named(name, row, message, tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [*GOOD, row])
    for read in (load, streamed):
        with pytest.raises(RecipeError, match=rf"d\.jsonl line 5: {message}"):
            read(tok, path)
    ds, report = load(tok, path, on_bad_row="skip")  # data.on_bad_row=skip counts it instead, and names it
    assert report.bad_rows_skipped == 1 and len(ds) == len(GOOD)
    assert re.search(rf"1 bad skipped; skipped: \S*d\.jsonl line 5: {message}", report.summary())


def test_prompt_completion_rows_are_checked_as_one_conversation(tok, tmp_path):
    rows = [{"prompt": "q?", "completion": "a."}, {"prompt": [{"role": "usr", "content": "q"}], "completion": "a"}]
    with pytest.raises(
        RecipeError,
        match=r"d\.jsonl line 2: prompt \+ completion\[0\]\.role='usr' is not a chat "
        r"role .*did you mean 'user'\?",
    ):
        load(tok, write_jsonl(tmp_path / "d.jsonl", rows))
    rows[1] = {"prompt": "q?", "completion": [{"role": "user", "content": "more?"}]}
    with pytest.raises(RecipeError, match=r"line 2: prompt \+ completion\[1\] is a second user turn in a row"):
        load(tok, write_jsonl(tmp_path / "d.jsonl", rows))


def test_a_lone_surrogate_in_a_text_row_and_a_json_array_with_a_key_twice(tok, tmp_path):
    with pytest.raises(RecipeError, match=r"d\.jsonl line 1: text holds a lone surrogate"):
        load(tok, write_jsonl(tmp_path / "d.jsonl", ['{"text": "abc\\udfff"}']))
    (tmp_path / "a.json").write_text('[{"text": "a", "text": "b"}]')
    with pytest.raises(RecipeError, match=r"a\.json: not a valid JSON array \(key 'text' appears twice"):
        load(tok, tmp_path / "a.json")


def test_tool_turns_are_checked_where_the_template_names_the_tool_role(tok, tmp_path):
    from finetune.data.messages import chat_roles, check_turns

    tools = "{% if message['role'] == 'tool' %}…{% endif %}"
    assert chat_roles(tools) == ("system", "user", "assistant", "tool")
    check_turns(
        turns(("user", "q"), ("assistant", "call"), ("tool", "42"), ("assistant", "It is 42."))["messages"],
        chat_roles(tools),
        "messages",
    )
    with pytest.raises(Exception, match=r"messages\[1\] is a tool turn after a user turn"):
        check_turns(turns(("user", "q"), ("tool", "42"), ("assistant", "a"))["messages"], chat_roles(tools), "messages")


# ---- CSV: text stays text ----


def test_csv_cells_stay_text_and_a_ragged_row_is_named(tok, tmp_path):
    (tmp_path / "d.csv").write_text(
        "prompt,completion\n" + "".join(f"what is {k}+1?,{k + 1}\n" for k in range(4)) + "nothing?,NA\nzero?,007\n"
    )
    for rows in (load(tok, tmp_path / "d.csv")[0], streamed(tok, tmp_path / "d.csv")):
        assert sorted(labelled(tok, r) for r in rows) == sorted(
            [f"{k + 1}<|im_end|>" for k in range(4)] + ["NA<|im_end|>", "007<|im_end|>"]
        )
    (tmp_path / "r.csv").write_text("prompt,completion\nhello,world\na,b,c,d\nx,y\n")
    for read in (load, streamed):
        with pytest.raises(
            RecipeError,
            match=r"r\.csv row 2: 4 cells on line 3 but the header has 2 \(prompt, "
            r"completion\); a value holding a comma needs quotes",
        ):
            read(tok, tmp_path / "r.csv")
    (tmp_path / "h.csv").write_text("prompt,prompt,completion\na,b,c\n")
    with pytest.raises(RecipeError, match=r"h\.csv: column 'prompt' appears twice in the header"):
        load(tok, tmp_path / "h.csv")
    (tmp_path / "l.csv").write_bytes("prompt,completion\ncaf\xe9,ok\n".encode("latin-1"))
    with pytest.raises(RecipeError, match=r"l\.csv line 2: not UTF-8 text; save the file as UTF-8"):
        load(tok, tmp_path / "l.csv")
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfprompt,completion\nq?,a.\n")  # as Excel writes it
    assert labelled(tok, load(tok, tmp_path / "bom.csv")[0][0]) == "a.<|im_end|>"


# ---- folders: nothing skipped in silence ----


def test_a_folder_names_what_it_cannot_read_and_reads_gzip(tok, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", GOOD)
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:  # read, and the streamed rows are the same
        f.write("".join(json.dumps(r) + "\n" for r in GOOD[:2]))
    (folder / "README.md").write_text("about this data")
    ds, report = load(tok, folder)
    assert len(ds) == 6 and report.rows_read == 6
    assert "1 other file(s) in the folder not read (README.md)" in report.summary()
    assert len(streamed(tok, folder)) == 6
    (folder / "c.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(RecipeError, match=r"data\.source=\S+data: \S+c\.jsonl is a link to nothing \(\S+gone\.jsonl"):
        load(tok, folder)
    (folder / "c.jsonl").unlink()
    os.symlink("d.jsonl", folder / "d.jsonl")  # a loop
    with pytest.raises(RecipeError, match=r"d\.jsonl is a link to nothing \(d\.jsonl, or a loop\)"):
        load(tok, folder)
    (folder / "d.jsonl").unlink()
    (folder / "e.jsonl.zst").write_bytes(b"(\xb5/\xfd")
    with pytest.raises(RecipeError, match=r"e\.jsonl\.zst is compressed \(\.zst\), which is not read; decompress it"):
        load(tok, folder)
    (folder / "e.jsonl.zst").unlink()
    (folder / "f.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(RecipeError, match=r"f\.jsonl\.gz: cannot read it \(.*gzip"):
        load(tok, folder)


def test_an_unreadable_file_is_named_where_it_is_read(tok, tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", GOOD)
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).endswith("a.jsonl"))
    with pytest.raises(RecipeError, match=r"\S+a\.jsonl cannot be read \(not a regular file, or no read permission\)"):
        load(tok, folder)
    monkeypatch.undo()

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("finetune.data.sources.open_data", denied)
    with pytest.raises(RecipeError, match=r"a\.jsonl: cannot read it \(Permission denied\)"):
        load(tok, folder / "a.jsonl")


# ---- a huge row costs what a long one does ----


def test_a_row_is_cut_before_it_is_tokenized_whole_and_keeps_its_first_tokens(tok, tmp_path):
    limit = char_limit(tok, 64)
    assert 64 * 2 <= limit <= 64 * 2 * 300
    long_answer = " ".join(f"word{k}" for k in range(limit // 3))  # longer than the cut
    rows = [chat("q?", long_answer)]
    cut = load(tok, write_jsonl(tmp_path / "d.jsonl", rows), max_length=64)
    whole = [tok.apply_chat_template(rows[0]["messages"], tokenize=False)]
    assert cut[0][0]["input_ids"] == tok(whole)["input_ids"][0][:64]
    text = " ".join(f"t{k}" for k in range(limit))
    cut = load(tok, write_jsonl(tmp_path / "t.jsonl", [{"text": text}]), max_length=64)
    assert cut[0][0]["input_ids"] == tok([text])["input_ids"][0][:64]
    with pytest.raises(RecipeError, match=r"d\.jsonl line 1: more than \d+ tokens, longer than data\.max_length=64"):
        load(tok, tmp_path / "d.jsonl", max_length=64, truncation="error")
    huge = write_jsonl(tmp_path / "huge.jsonl", [chat("q?", "word " * 4_000_000)])  # 20 MB
    start = time.monotonic()
    ds, report = load(tok, huge, max_length=64)
    assert len(ds[0]["input_ids"]) == 64 and report.truncated == 1
    assert time.monotonic() - start < 60


# ---- through the command ----


def test_a_bad_row_read_by_a_dataloader_worker_is_one_line(tmp_path, capfd):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD * 20 + ["{oops"])
    out = tmp_path / "out"
    result = call(
        capfd,
        [
            f"recipe={DEBUG}",
            f"data.source={path}",
            "data.streaming=true",
            "data.num_workers=1",
            "data.limit=null",
            "train.max_steps=12",
            "data.max_length=64",
            f"train.output_dir={out}",
        ],
    )
    assert_one_error(
        result,
        r"^error: \S+d\.jsonl line 81: not valid JSON \(.*\) \(data\.on_bad_row=skip skips such "
        r"rows\)$",
        out,
    )


@pytest.mark.parametrize(
    "name, make, message",
    [
        (
            "role typo",
            lambda t: write_jsonl(t / "d.jsonl", [*GOOD, turns(("user", "q"), ("assitant", "a"))]),
            r"d\.jsonl line 5: messages\[1\]\.role='assitant' is not a chat role",
        ),
        (
            "dangling link",
            lambda t: (write_jsonl(t / "a.jsonl", GOOD), (t / "b.jsonl").symlink_to(t / "gone"), t)[-1],
            r"b\.jsonl is a link to nothing",
        ),
        ("empty source", lambda t: "", r"^error: data\.source is empty"),
    ],
    ids=["role typo", "dangling link", "empty source"],
)
def test_train_names_the_row_or_file_exit_2_nothing_written(name, make, message, tmp_path, capfd):
    source = make(tmp_path)
    out = tmp_path / "out"
    result = call(
        capfd,
        [
            f"recipe={DEBUG}",
            f"data.source={source}",
            "data.max_length=64",
            "train.max_steps=2",
            f"train.output_dir={out}",
        ],
    )
    assert_one_error(result, message, out)


def peak_rss_kib() -> int:
    """This process's peak resident memory (VmHWM) since 5 was last written to /proc/self/clear_refs."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB$", status, re.M)[1])


def test_a_50_mb_row_trains_in_the_memory_of_a_short_one(tmp_path, capfd):
    """The issue's 50 MB row took 13 GB: rendered and tokenized whole (and twice more for its label span)."""
    path = write_jsonl(tmp_path / "d.jsonl", [*GOOD, chat("long?", "word " * 10_000_000)])
    # the peak from here on: the kernel resets this process's high-water mark to its resident memory now
    Path("/proc/self/clear_refs").write_text("5")
    result = call(
        capfd,
        [
            f"recipe={DEBUG}",
            f"data.source={path}",
            "data.max_length=64",
            "train.max_steps=1",
            f"train.output_dir={tmp_path / 'out'}",
        ],
    )
    peak_kib = peak_rss_kib()
    assert result.returncode == 0, result.stderr[-3000:]
    assert peak_kib < 3 * 2**20, f"peak RSS {peak_kib / 2**20:.1f} GiB"
