"""Chat rows to rendered text and trained spans through a tokenizer's (or processor's) chat template, and the spans
to token labels: the assistant-only loss of finetune/data/text.py and vision.py.

`template_facts(tokenizer)` reads the template once (finetune/data/chat_spans.py: its generation prompt, the
tokenizer's special tokens, its markup); `conversation_rows` renders a conversation once per training row
(`data.turn_rows`: the whole conversation, or one row per assistant turn with that turn last) and locates the trained
spans; `token_labels` marks every token that overlaps a trained span; `check_labels` proves on every row that each
trained turn's text lies inside the labels and no other message's does (string and integer work, no model).
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Sequence

from finetune.core.labels import IGNORE_INDEX
from finetune.data.chat_spans import Located, Span, TemplateFacts, TurnError, locate
from finetune.data.sources import BadRow
from finetune.data.template_probe import read_template
from finetune.recipe import RecipeError, first_line


class Refused(BadRow):
    """The chat template raised on a conversation (jinja's raise_exception, an undefined name): `why` is its line."""

    def __init__(self, why: str):
        super().__init__(f"the chat template refuses it ({why})")
        self.why = why


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def _tokenizer_of(tokenizer):
    return getattr(tokenizer, "tokenizer", None) or tokenizer  # a processor's tokenizer


def special_tokens(tokenizer) -> list[str]:
    """The tokens that end a turn: the tokenizer's special tokens and its added tokens marked special."""
    tok = _tokenizer_of(tokenizer)
    added = [t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special]
    return [*tok.all_special_tokens, *added]


def added_tokens(tokenizer) -> list[str]:
    return [t.content for t in getattr(_tokenizer_of(tokenizer), "added_tokens_decoder", {}).values()]


def render(tokenizer, messages: list[dict], tools: list | None = None, generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (BadRow: the template refuses them, with its reason)."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # jinja's raise_exception: e.g. roles that do not alternate
        raise Refused(first_line(e)) from None


def render_tagged(tokenizer, messages: list[dict], tools: list | None = None) -> tuple[str, list[Span]]:
    """The text and its `{% generation %}` spans, as transformers' return_assistant_tokens_mask finds them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = _tokenizer_of(tokenizer)
    try:
        texts, indices = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template_text(tokenizer),
            return_assistant_tokens_mask=True,
            **tok.special_tokens_map,
        )
    except Exception as e:
        raise Refused(first_line(e)) from None
    return texts[0], [tuple(span) for span in indices[0]]


@functools.lru_cache(maxsize=16)
def _facts(tokenizer, template: str) -> TemplateFacts:
    try:
        return read_template(
            template,
            lambda m: render(tokenizer, m),
            lambda m: render(tokenizer, m, generation_prompt=True),
            special_tokens(tokenizer),
            added_tokens(tokenizer),
        )
    except Refused as e:
        raise RecipeError(f"the template does not render a user/assistant conversation ({e.why})") from None
    except TurnError as e:
        raise RecipeError(str(e)) from None


def template_facts(tokenizer) -> TemplateFacts:
    """The facts labelling needs of this tokenizer's chat template, read once per template (RecipeError: a template
    whose turns cannot be found in a probe conversation)."""
    return _facts(tokenizer, template_text(tokenizer))


PROBE_CALL = [
    {"role": "user", "content": "probe question"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "probe", "arguments": {"a": 1}}}],
    },
]


@functools.lru_cache(maxsize=16)
def _string_arguments(tokenizer, template: str) -> bool:
    """Whether the template takes a tool call's arguments as a JSON string only (DeepSeek-V3's concatenates them):
    it refuses them as an object, the form transformers documents, and renders them as a string."""
    try:
        render(tokenizer, PROBE_CALL)
        return False
    except Refused:
        pass
    try:
        render(tokenizer, with_string_arguments(PROBE_CALL))
        return True
    except Refused:
        return False


def with_string_arguments(messages: list[dict]) -> list[dict]:
    """Each tool call's arguments as a JSON string."""
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def conversation_rows(
    tokenizer, messages: list[dict], turns: list[int], turn_rows: str, tools: list | None = None
) -> list[Located]:
    """The training rows of one conversation, each rendered once with its trained spans: the whole conversation
    (`turn_rows="conversation"`, every turn in `turns` trained), or one row per turn in `turns` ending with it
    ("per_turn": its context as the template renders it for generating that turn)."""
    facts = template_facts(tokenizer)
    if any("tool_calls" in m for m in messages) and _string_arguments(tokenizer, template_text(tokenizer)):
        messages = with_string_arguments(messages)
    rows = [(messages, turns)] if turn_rows == "conversation" else [(messages[: i + 1], [i]) for i in turns]
    out = []
    for row, trained in rows:
        try:
            out.append(
                locate(
                    row,
                    trained,
                    lambda m: render(tokenizer, m, tools),
                    facts,
                    lambda m: render_tagged(tokenizer, m, tools),
                )
            )
        except TurnError as e:
            raise BadRow(str(e)) from None
    return out


class Offsets:
    """A row's token offsets (characters of the rendering, in order, as a fast tokenizer gives them)."""

    def __init__(self, offsets: Sequence[Span]):
        self.starts = [a for a, _ in offsets]
        self.ends = [b for _, b in offsets]

    def overlapping(self, span: Span) -> range:
        """The tokens whose characters overlap `span`."""
        return range(bisect.bisect_right(self.ends, span[0]), bisect.bisect_left(self.starts, span[1]))


def token_labels(ids: Sequence[int], offsets: Offsets, spans: Sequence[Span]) -> list[int]:
    """Each token that overlaps a trained span is its own target; the rest IGNORE_INDEX."""
    labels = [IGNORE_INDEX] * len(ids)
    for span in spans:
        for k in offsets.overlapping(span):
            labels[k] = ids[k]
    return labels


def check_labels(located: Located, offsets: Offsets, labels: Sequence[int]) -> None:
    """Every token of a trained assistant turn's text is a target and no token of another message's text is: else
    the template joins turns into one token (or its tags leave part of a turn out), and the row is one BadRow."""
    trained = set(located.trained_turns)
    for k, region in enumerate(located.regions):
        if region is None:
            continue
        marks = [labels[j] != IGNORE_INDEX for j in offsets.overlapping(region)]
        if k in trained and not all(marks):
            raise BadRow(
                f"assistant turn messages[{k}]: part of its text is outside the trained tokens (the chat template's "
                "{% generation %} tags leave it out, or a token joins it with the text around it); fix the template "
                "(data.chat_template)"
            )
        if k not in trained and any(marks):
            raise BadRow(
                f"messages[{k}]: the chat template joins its text and a trained assistant turn's into one token, so "
                "the labels cannot keep them apart; give a template that separates the turns (data.chat_template)"
            )


def marked(tokenizer, ids: Sequence[int], labels: Sequence[int]) -> str:
    """A row as it trains: its text with each run of targets between ⟦ and ⟧ (--dry-run)."""
    pieces, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or (labels[k] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            text = tokenizer.decode(ids[start:k])
            pieces.append(f"⟦{text}⟧" if labels[start] != IGNORE_INDEX else text)
            start = k
    return "".join(pieces)
