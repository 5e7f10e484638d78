"""`data.chat_template`: the chat template chat rows are rendered with, when the model's own will not do (a base model
has none). A built-in name (`BUILT_IN`) or a Jinja file; it replaces the tokenizer's template for the whole run, so
the saved model carries it and serving renders prompts as training did.

The assistant-only labels (finetune/data/chat_labels.py) find each turn in one rendering of the whole conversation;
`check_template` reads the template on a probe conversation before any row is read (its turns must be found in the
rendering), so a template that cannot label is one error, not a label silently on the wrong tokens.
"""

from __future__ import annotations

from pathlib import Path

from finetune.data.chat_labels import template_facts
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


def check_template(name: str, tokenizer) -> None:
    """The template renders a user/assistant conversation and shows each turn where the labels can find it."""
    try:
        template_facts(tokenizer)
    except RecipeError as e:
        raise RecipeError(f"data.chat_template={name}: {e}") from None


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
