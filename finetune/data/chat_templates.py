"""`data.chat_template`: the chat template chat rows are rendered with, when the model's own will not do (a base model
has none). A built-in name (`BUILT_IN`) or a Jinja file; it replaces the tokenizer's template for the whole run, so
the saved model carries it and serving renders prompts as training did.

The assistant-only labels (finetune/data/text.py) find each assistant turn by prefix renderings, which needs a
template that marks where an assistant turn starts: rendered with `add_generation_prompt`, a conversation must end
exactly where the assistant's next turn begins. `use_chat_template` checks that on a probe conversation before any row
is read, so a template that cannot label is one error, not a label silently on the wrong tokens.
"""

from __future__ import annotations

from pathlib import Path

from finetune.recipe import DataConfig, RecipeError, first_line

# ChatML (Qwen, SmolLM2, Hermes): <|im_start|>ROLE\nCONTENT<|im_end|>\n; the generation prompt opens an assistant turn
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BUILT_IN = {"chatml": CHATML}

NO_TEMPLATE = (
    "the model's tokenizer has no chat template, so chat rows (messages, prompt/completion) cannot be rendered; set "
    f"data.chat_template to a built-in template ({', '.join(BUILT_IN)}) or a Jinja file, or use text rows"
)

PROBE = [  # distinct words, so each turn's content can be found in the rendering
    {"role": "user", "content": "probe question one"},
    {"role": "assistant", "content": "probe answer one"},
    {"role": "user", "content": "probe question two"},
    {"role": "assistant", "content": "probe answer two"},
]


def template_text(name: str) -> str:
    """A built-in template's text, or the contents of the Jinja file `name`."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    path = Path(name).expanduser()
    if not path.is_file():
        raise RecipeError(
            f"data.chat_template={name}: not a built-in template ({', '.join(BUILT_IN)}) and no such file; give "
            "one of those names or the path of a Jinja file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"data.chat_template={name}: cannot read it ({first_line(e)})") from None
    if not text.strip():
        raise RecipeError(f"data.chat_template={name}: the file is empty; give a Jinja chat template")
    return text


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def check_template(name: str, tokenizer) -> None:
    """The template (already on `tokenizer`) renders a user/assistant conversation, shows each turn's content, and
    marks where an assistant turn starts (the prefix the assistant-only labels are cut at)."""
    where = f"data.chat_template={name}"
    try:
        whole = _render(tokenizer, PROBE, False)
        prefixes = [(_render(tokenizer, PROBE[:i], True), _render(tokenizer, PROBE[:i], False)) for i in (1, 3)]
        turns = [_render(tokenizer, PROBE[: i + 1], False) for i in (1, 3)]
    except Exception as e:  # jinja's syntax errors, undefined names, raise_exception
        why = first_line(e)
        raise RecipeError(f"{where}: the template does not render a user/assistant conversation ({why})") from None
    missing = [m["content"] for m in PROBE if m["content"] not in whole]
    if missing:
        raise RecipeError(f"{where}: the template leaves out message content ('{missing[0]}'); render its content")
    for (prompted, plain), turn, answer in zip(prefixes, turns, (PROBE[1], PROBE[3])):
        marked = len(prompted) > len(plain) and turn.startswith(prompted)
        if not marked or answer["content"] not in turn[len(prompted) :]:
            raise RecipeError(
                f"{where}: the template has no assistant turn marker the labels can use (with add_generation_prompt "
                "it must end exactly where the assistant's turn starts, and add text there); add "
                "{% if add_generation_prompt %}<the assistant turn's header>{% endif %} at its end"
            )


def use_chat_template(data: DataConfig, tokenizer) -> None:
    """Give `tokenizer` (or a processor and its tokenizer) the template data.chat_template names, checked."""
    if not data.chat_template:
        return
    text = template_text(data.chat_template)
    for holder in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        if holder is not None:
            holder.chat_template = text
    check_template(data.chat_template, tokenizer)


def require_chat_template(tokenizer) -> None:
    """Chat rows need a template: without one, the error names data.chat_template (not one bad row per row)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(NO_TEMPLATE)
