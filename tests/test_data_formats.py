"""Data as it comes: ShareGPT and Alpaca rows, and other columns, role names and message keys (data.columns,
data.roles, data.message_keys), tokenized and labelled exactly as the same conversation in messages rows; a row that
does not fit is one error naming the file, the line, the field and the key that would read it."""

import pytest
from transformers import AutoTokenizer

from finetune.data.formats import FORMAT_COLUMNS, as_read, form, rows_as_read
from finetune.data.streaming import stream_sft_dataset
from finetune.data.text import load_sft_dataset
from finetune.evaluation.prompts import sample_prompts
from finetune.recipe import DataConfig, RecipeError, load_config
from finetune.recipe.data_schema import ROW_FIELDS
from tests.data_files import smollm2_folder, write_jsonl

EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


def load(tok, path, **kw):
    return load_sft_dataset(DataConfig(source=str(path), **kw), tok)


def messages(*pairs):
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


def same_rows(tok, tmp_path, rows, reference, loss_on="assistant", **keys):
    """The rows (read with the data keys `keys`) load to exactly the tokens and labels of the reference messages
    rows; their DataReport."""
    ds, report = load(tok, write_jsonl(tmp_path / "rows.jsonl", rows), loss_on=loss_on, **keys)
    expected, _ = load(tok, write_jsonl(tmp_path / "reference.jsonl", reference), loss_on=loss_on)
    assert ds.to_dict() == expected.to_dict()
    return report


CONVERSATION = [
    ("system", "Answer in one sentence."),
    ("user", "Capital of France?"),
    ("assistant", "Paris."),
    ("user", "And of Italy?"),
    ("assistant", "Rome."),
]


# ---- ShareGPT ----


@pytest.mark.parametrize("loss_on", ["assistant", "completion", "all"])
def test_sharegpt_rows_tokenize_and_label_as_the_same_messages(tok, tmp_path, loss_on):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    with_turn = {"conversations": [{"from": names[r], "value": c} for r, c in CONVERSATION]}
    with_column = {"system": CONVERSATION[0][1], "conversations": with_turn["conversations"][1:]}
    openai_names = {"conversations": [{"from": r, "value": c} for r, c in CONVERSATION[1:]], "system": ""}
    report = same_rows(
        tok,
        tmp_path,
        [with_turn, with_column, openai_names],
        [messages(*CONVERSATION), messages(*CONVERSATION), messages(*CONVERSATION[1:])],
        loss_on=loss_on,
    )
    assert report.format == "sharegpt" and "rows.jsonl (sharegpt): 3 of 3 rows kept" in report.summary()


def test_sharegpt_tool_roles_become_assistant_and_tool_turns():
    row = {
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": '{"temp": 21}'},
            {"from": "gpt", "value": "21 degrees."},
        ]
    }
    roles = [m["role"] for m in as_read("sharegpt", row, DataConfig())["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_sharegpt_is_streamed_and_prompted_as_messages(tok, tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": f"Question {k}?"}, {"from": "gpt", "value": "Yes."}]}
        for k in range(3)
    ]
    data = DataConfig(source=str(write_jsonl(tmp_path / "s.jsonl", rows)), streaming=True)
    streamed, report = stream_sft_dataset(data, tok)
    in_memory, _ = load_sft_dataset(data, tok)
    assert report.format == "sharegpt" and list(streamed.rows()) == in_memory.to_list()
    records = [(f"s.jsonl line {k + 1}", r) for k, r in enumerate(rows)]
    (prompt,) = sample_prompts(rows_as_read("sharegpt", records, data), form("sharegpt"), 1, [], tok, False)
    assert (prompt.shown, prompt.reference) == ("Question 0?", "Yes.")


# ---- Alpaca ----


def test_alpaca_rows_tokenize_and_label_as_the_same_messages(tok, tmp_path):
    rows = [
        {"instruction": "Capital of France?", "input": "", "output": "Paris."},
        {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
        {
            "system": "Answer in one sentence.",
            "instruction": "And of Italy?",
            "output": "Rome.",
            "history": [["Capital of France?", "Paris."]],
        },
    ]
    reference = [
        messages(("user", "Capital of France?"), ("assistant", "Paris.")),
        messages(("user", "Translate to French.\nGood morning"), ("assistant", "Bonjour")),
        messages(*CONVERSATION),
    ]
    report = same_rows(tok, tmp_path, rows, reference)
    assert report.format == "alpaca" and "(alpaca)" in report.summary()
    ds, _ = load(tok, tmp_path / "rows.jsonl", loss_on="completion")  # history's answers are not the completion
    assert tok.decode([t for t in ds[2]["labels"] if t != -100]) == "Rome." + EOT


# ---- your own columns, roles and message keys ----


def test_columns_read_other_names_as_prompt_and_completion(tok, tmp_path):
    rows = [{"question": "2 + 2?", "answer": "4", "id": 7}]
    report = same_rows(
        tok,
        tmp_path,
        rows,
        [messages(("user", "2 + 2?"), ("assistant", "4"))],
        columns={"prompt": "question", "completion": "answer"},
    )
    assert report.format == "prompt_completion"


def test_columns_roles_and_message_keys_read_any_conversation(tok, tmp_path):
    rows = [{"dialog": [{"speaker": "person", "text": "Hi?"}, {"speaker": "bot", "text": "Hello."}]}]
    keys = {"columns": {"messages": "dialog"}, "message_keys": {"role": "speaker", "content": "text"}}
    report = same_rows(
        tok,
        tmp_path,
        rows,
        [messages(("user", "Hi?"), ("assistant", "Hello."))],
        roles={"person": "user", "bot": "assistant"},
        **keys,
    )
    assert report.format == "messages"
    sharegpt = [{"chat": [{"from": "human", "value": "Hi?"}, {"from": "robot", "value": "Hello."}]}]
    report = same_rows(
        tok,
        tmp_path,
        sharegpt,
        [messages(("user", "Hi?"), ("assistant", "Hello."))],
        format="sharegpt",
        columns={"conversations": "chat"},
        roles={"robot": "assistant"},
    )
    assert report.format == "sharegpt"


def test_the_mapping_keys_load_from_a_recipe_and_are_checked():
    config = load_config(
        [
            "model.name_or_path=m",
            "data.format=alpaca",
            "data.columns={instruction: question, output: answer}",
            "data.roles.bot=assistant",
            "data.message_keys={role: from, content: value}",
        ]
    )
    data = config.data
    assert (data.format, data.columns, data.roles) == (
        "alpaca",
        {"instruction": "question", "output": "answer"},
        {"bot": "assistant"},
    )
    for bad, message in [
        ("data.columns.question=q", r"data.columns.question=q: 'question' is not one of messages, conversations"),
        ("data.roles.bot=robot", r"data.roles.bot=robot: 'robot' is not one of user, assistant, system, tool"),
        ("data.message_keys.text=value", r"data.message_keys.text=value: 'text' is not one of role, content"),
        ("data.format=sharegtp", r"data.format='sharegtp' is not one of .*did you mean 'sharegpt'\?"),
    ]:
        with pytest.raises(RecipeError, match=message):
            load_config(["model.name_or_path=m", bad])


def test_the_schema_names_every_field_a_format_reads():
    read = {c for columns in FORMAT_COLUMNS.values() for c in columns} | {"input", "system", "history", "tools"}
    assert set(ROW_FIELDS) == read


# ---- rows that do not fit: one error naming the file, the line, the field and the key ----

GOOD_SHAREGPT = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
GOOD_ALPACA = {"instruction": "q", "output": "a"}


@pytest.mark.parametrize(
    "row, keys, message",
    [
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
            {},
            r"conversations\[1\]\.from='bot' is not a ShareGPT role \(human, .*\); "
            r"data\.roles=\{bot: assistant\} maps it",
        ),
        (
            {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {},
            r"conversations\[0\] has no 'from' \(it has: role, content\); "
            r"data\.message_keys=\{role: KEY, content: KEY\}",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
            {},
            r"conversations\[1\]\.value is empty",
        ),
        (
            {"system": "s", "conversations": [{"from": "system", "value": "s"}, *GOOD_SHAREGPT["conversations"]]},
            {},
            r"a system column and a system turn \(conversations\[0\]\); keep one",
        ),
        (
            {"instruction": "q", "response": "a"},
            {},
            r"missing output \(row has: instruction, response\); data\.columns=\{output: YOUR_COLUMN\} reads it",
        ),
        (
            {"instruction": "q", "output": "a", "history": [["only an instruction"]]},
            {},
            r"history\[0\] is not an \[instruction, output\] pair",
        ),
        (
            {"instruction": "q", "input": 3, "output": "a"},
            {},
            r"input is int, not a string",
        ),
        (
            messages(("user", "q"), ("bot", "a")),
            {},
            r"messages\[1\]\.role='bot' is not a chat role \(system, user, assistant\); data\.roles=\{bot: ROLE\}",
        ),
        (
            {"question": "q"},
            {"columns": {"prompt": "question", "completion": "answer"}},
            r"missing completion \(row has: prompt\); data\.columns=\{completion: YOUR_COLUMN\}",
        ),
    ],
    ids=[
        "sharegpt role",
        "sharegpt message keys",
        "sharegpt empty value",
        "sharegpt system twice",
        "alpaca output column",
        "alpaca history pair",
        "alpaca input type",
        "messages role",
        "columns row lacks one",
    ],
)
def test_a_row_that_does_not_fit_is_one_error_naming_file_line_field_and_key(tok, tmp_path, row, keys, message):
    first = GOOD_SHAREGPT if "conversations" in row else GOOD_ALPACA if "instruction" in row else None
    first = first or (
        {"question": "q0", "answer": "a0"} if "question" in row else messages(("user", "q"), ("assistant", "a"))
    )
    path = write_jsonl(tmp_path / "d.jsonl", [first, row])
    with pytest.raises(RecipeError, match=r"d\.jsonl line 2: " + message) as error:
        load(tok, path, **keys)
    assert str(error.value).count("d.jsonl") == 1 and "data.on_bad_row=skip skips such rows" in str(error.value)
    ds, report = load(tok, path, on_bad_row="skip", **keys)
    assert (len(ds), report.bad_rows_skipped) == (1, 1)


def test_a_refused_file_names_the_formats_looked_for_and_the_mapping_keys(tok, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(RecipeError) as error:
        load(tok, path)
    assert str(error.value) == (
        f"data.source={path}: columns found: question, answer; expected messages; conversations (sharegpt); "
        "instruction + output (alpaca); prompt + completion; text; data.columns reads yours as these "
        "(e.g. data.columns={prompt: question, completion: answer})"
    )
    with pytest.raises(
        RecipeError, match=r"expected conversations \(data.format=sharegpt\); data\.columns=\{conversations: "
    ):
        load(tok, path, format="sharegpt")
    with pytest.raises(RecipeError, match=r"no row has the column query \(data\.columns\.prompt=query\)"):
        load(tok, path, columns={"prompt": "query", "completion": "answer"})
