"""data.chat_template: a base model (a tokenizer without a chat template) trains on `messages` rows with the built-in
ChatML template, its assistant-only labels exactly the assistant turns; a missing or unusable template is one error
line naming the key, exit 2, nothing written."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from finetune.core.labels import IGNORE_INDEX
from finetune.data.chat_templates import CHATML, use_chat_template
from finetune.data.text import load_sft_dataset
from finetune.model.loading import load_tokenizer, model_folder
from finetune.recipe import DataConfig, RecipeError, load_config
from tests.launch import call

CONVERSATIONS = [
    [("user", f"What is {k} plus {k}?"), ("assistant", f"It is {2 * k}."), ("user", "Sure?"), ("assistant", "Yes.")]
    for k in range(16)
]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """The debug recipe's model folder without its chat template: what a base model's folder looks like."""
    cfg = load_config(["recipe=recipes/debug.yaml"])
    source = Path(model_folder(cfg.model))
    folder = tmp_path_factory.mktemp("base") / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, folder / name)
    settings = json.loads((source / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def messages_file(path: Path) -> Path:
    rows = [{"messages": [{"role": r, "content": c} for r, c in turns]} for turns in CONVERSATIONS]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_chatml_labels_are_exactly_the_assistant_turns(base_model, tmp_path):
    cfg = load_config(["recipe=recipes/debug.yaml", f"model.name_or_path={base_model}", "model.gguf_file=null"])
    tokenizer = load_tokenizer(cfg.model, str(base_model))
    assert not tokenizer.chat_template
    data = DataConfig(source=str(messages_file(tmp_path / "chat.jsonl")), chat_template="chatml", max_length=512)
    use_chat_template(data, tokenizer)
    dataset, report = load_sft_dataset(data, tokenizer)
    assert report.rows_kept == len(CONVERSATIONS)

    def pieces(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for row, turns in zip(dataset, CONVERSATIONS):  # brute force: each turn's parts tokenized on their own
        ids, labels = [], []
        for role, content in turns:
            header, body, end = pieces(f"<|im_start|>{role}\n"), pieces(content + "<|im_end|>"), pieces("\n")
            ids += header + body + end
            labels += [IGNORE_INDEX] * len(header) + (body if role == "assistant" else [IGNORE_INDEX] * len(body))
            labels += [IGNORE_INDEX] * len(end)
        assert row["input_ids"] == ids
        assert row["labels"] == labels
        spans = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
        assert spans == "".join(c + "<|im_end|>" for r, c in turns if r == "assistant")


def test_template_file_is_used_as_given(base_model, tmp_path):
    """A Jinja file is read as it is (here ChatML with another end marker), and replaces the tokenizer's template."""
    cfg = load_config(["recipe=recipes/debug.yaml"])
    tokenizer = load_tokenizer(cfg.model, model_folder(cfg.model))
    assert tokenizer.chat_template != CHATML
    own = tmp_path / "own.jinja"
    own.write_text(CHATML.replace("<|im_end|>", "<|endoftext|>"))
    data = DataConfig(source=str(messages_file(tmp_path / "chat.jsonl")), chat_template=str(own), max_length=512)
    use_chat_template(data, tokenizer)
    assert tokenizer.chat_template == own.read_text()
    dataset, _ = load_sft_dataset(data, tokenizer)
    labelled = tokenizer.decode([t for t in dataset[0]["labels"] if t != IGNORE_INDEX])
    assert labelled == "It is 0.<|endoftext|>Yes.<|endoftext|>"


def run(capfd, argv: list[str], out: Path) -> subprocess.CompletedProcess:
    base = ["recipe=recipes/debug.yaml", "data.limit=16", "train.max_steps=2", "log.wandb_mode=disabled"]
    return call(capfd, [*base, f"train.output_dir={out}", *argv])


def test_base_model_trains_on_messages_with_chatml(base_model, tmp_path, capfd):
    out = tmp_path / "out"
    model = [f"model.name_or_path={base_model}", "model.gguf_file=null"]
    source = f"data.source={messages_file(tmp_path / 'chat.jsonl')}"
    result = run(capfd, [*model, source, "data.chat_template=chatml"], out)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"^step 2/2 .*loss \d", result.stdout, re.M), result.stdout
    assert (out / "chat_template.jinja").read_text() == CHATML  # served as it was trained


NOT_RENDERING = "{% for message in messages %}{{ message['content'] }"  # an unclosed expression
NO_TURN_END = "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"


@pytest.mark.parametrize(
    "template, message",
    [
        (
            None,
            r"^error: the model's tokenizer has no chat template, so chat rows \(messages, prompt/completion\) "
            r"cannot be rendered; set data\.chat_template to a built-in template \(chatml\) or a Jinja file, or use "
            r"text rows$",
        ),
        (
            "nope.jinja",
            r"^error: data\.chat_template=\S*nope\.jinja: not a built-in template \(chatml\) and no such file; give "
            r"one of those names or the path of a Jinja file$",
        ),
        (
            NOT_RENDERING,
            r"^error: data\.chat_template=\S+\.jinja: the template does not render a user/assistant conversation "
            r"\(.+\)$",
        ),
        (
            NO_TURN_END,
            r"^error: data\.chat_template=\S+\.jinja: the template ends an assistant turn with no special token of "
            r"the tokenizer, so the model would never learn to stop; end each turn with one",
        ),
    ],
    ids=["no template", "no such file", "does not render", "no turn end"],
)
def test_bad_template_is_one_error_line_exit_2(base_model, tmp_path, template, message, capfd):
    out = tmp_path / "out"
    argv = [f"model.name_or_path={base_model}", "model.gguf_file=null"]
    argv.append(f"data.source={messages_file(tmp_path / 'chat.jsonl')}")
    if template == "nope.jinja":
        argv.append(f"data.chat_template={tmp_path / template}")
    elif template is not None:
        (tmp_path / "bad.jinja").write_text(template)
        argv.append(f"data.chat_template={tmp_path / 'bad.jinja'}")
    result = run(capfd, argv, out)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-4000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    assert re.search(message, errors[0]), errors[0]
    written = [p for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
    assert written == [], f"left in the output directory: {written}"


def test_no_template_error_names_the_key(base_model):
    cfg = load_config(["recipe=recipes/debug.yaml", f"model.name_or_path={base_model}", "model.gguf_file=null"])
    tokenizer = load_tokenizer(cfg.model, str(base_model))
    from finetune.data.text import render_chat

    with pytest.raises(RecipeError, match=r"data\.chat_template"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], True)
