"""Which characters of one rendering of a whole conversation an assistant-only loss trains: string work over a render
function (the chat template), no tokens.

The conversation is rendered once, as the template renders it. Each message is found in that text by rendering it
again with that message's text changed (`altered`: every character but whitespace and the template's markup
replaced): what differs is where the template put the message (`changed`). An assistant turn's trained span is what
the model generates after the generation prompt: from the end of its header to the end of the token that ends it.
The header is the text `add_generation_prompt` appends (or, where that adds nothing, the text a plain turn has before
its content); the end is the first special token after the turn's own text and before the next message's (`<|im_end|>`,
`<|eot_id|>`, `<end_of_turn>`, GLM's next role token `<|user|>`). Nothing of this depends on the template rendering a
conversation's prefix as it renders the whole: templates that render earlier turns differently (Qwen3, gpt-oss,
OLMo 3) are labelled as they render them. Where a template has `{% generation %}` tags, they decide the spans.

A field that renders nothing when changed is dropped by the template (earlier turns' reasoning, tool calls a template
never reads): `Located.dropped` says which, so the data line can count them. Imports only the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for an assistant's reasoning
ASSISTANT_FIELDS = ("content", *REASONING_FIELDS, "tool_calls")
KEPT_KEYS = ("type", "id", "tool_call_id", "role", "name", "image", "url", "path")  # never text the template shows
DATA_KEYS = ("arguments", "parameters")  # a tool call's arguments: their names are the call's text too
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"

Span = tuple[int, int]  # [start, end) characters of a rendering


class TurnError(ValueError):
    """A conversation whose turns cannot be told apart in its rendering; the message says which and what to do."""


@dataclass(frozen=True)
class TemplateFacts:
    """What labelling needs of a template, read once: its generation prompt (the assistant turn's header), the header
    a plain assistant turn has where that prompt adds nothing, the tokenizer's special tokens (turn ends), the markup
    a row's text keeps when altered, the token to append after a last turn that the template ends with none (GLM: the
    next role's token, which ends its other turns), and whether `{% generation %}` tags decide."""

    generation_prompt: str
    header: str
    specials: re.Pattern | None
    protected: re.Pattern | None
    stop: str | None = None
    tagged: bool = False
    ends: re.Pattern | None = None  # the tokens that end a plain assistant turn in the probe (`<|end|>`, `<|return|>`)

    def first_special(self, text: str, start: int, end: int) -> re.Match | None:
        return self.specials.search(text, start, end) if self.specials is not None else None


@dataclass
class Located:
    """One rendering: its text, each message's span in it (None: the template shows nothing of it), the trained spans
    and the fields the template dropped ({(message index, field)})."""

    text: str
    regions: list[Span | None]
    trained: list[Span] = field(default_factory=list)
    trained_turns: list[int] = field(default_factory=list)
    dropped: set[tuple[int, str]] = field(default_factory=set)
    carried: set[tuple[int, str]] = field(default_factory=set)  # (message, "reasoning" | "tool_calls") it holds
    appended: str | None = None  # the stop token append_stop added after the last turn

    def trained_fields(self, which: str) -> list[tuple[bool, bool]]:
        """For each trained turn that carries `which` ("reasoning" or "tool_calls"): (dropped by the template,
        whether the turn is the rendering's last message)."""
        last = len(self.regions) - 1
        return [((k, which) in self.dropped, k == last) for k in self.trained_turns if (k, which) in self.carried]


# ---- changing a message's text ----


def pattern_of(strings) -> re.Pattern | None:
    """A regex matching any of `strings`, longest first (so `<|im_end|>` is not read as `<|im`)."""
    strings = sorted({s for s in strings if s}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, strings))) if strings else None


def _alter_char(c: str) -> str:
    if c.isspace():
        return c
    if "a" <= c <= "z" or "A" <= c <= "Z" or "0" <= c <= "9":
        base = "a" if c.islower() else "A" if c.isupper() else "0"
        size = 10 if base == "0" else 26
        return chr(ord(base) + (ord(c) - ord(base) + 1) % size)
    if c in PUNCTUATION:
        return PUNCTUATION[(PUNCTUATION.index(c) + 1) % len(PUNCTUATION)]
    return "x"


def _alter_text(text: str, protected: re.Pattern | None) -> str:
    """Every character changed but whitespace and the markup `protected` matches (kept whole)."""
    out, at = [], 0
    for match in protected.finditer(text) if protected is not None else ():
        out.append("".join(map(_alter_char, text[at : match.start()])))
        out.append(match.group())
        at = match.end()
    out.append("".join(map(_alter_char, text[at:])))
    return "".join(out)


def altered(value, protected: re.Pattern | None):
    """`value` (a message field: text, a list of content parts, tool calls) with every text and number in it changed,
    its shape kept: the keys, ids, types and booleans a template branches on stay."""
    if isinstance(value, str):
        return _alter_text(value, protected)
    if isinstance(value, list):
        return [altered(v, protected) for v in value]
    if isinstance(value, dict):
        return {k: v if k in KEPT_KEYS else _altered_value(k, v, protected) for k, v in value.items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value + 1
    return value


def _altered_value(key: str, value, protected: re.Pattern | None):
    if key in DATA_KEYS and isinstance(value, dict):
        return {_alter_text(k, protected): altered(v, protected) for k, v in value.items()}
    return altered(value, protected)


# ---- where a message lies ----


def prefix_length(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; found by halving (slices compare at C speed)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _suffix_length(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid : len(a) - lo] == b[len(b) - mid : len(b) - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def changed(text: str, other: str) -> Span | None:
    """The span of `text` that differs from `other` (None: the same text)."""
    if text == other:
        return None
    start = prefix_length(text, other)
    end = len(text) - _suffix_length(text, other, min(len(text), len(other)) - start)
    return start, max(end, start)


def _fields(message: dict) -> tuple[str, ...]:
    names = ASSISTANT_FIELDS if message.get("role") == "assistant" else ("content",)
    return tuple(name for name in names if message.get(name) not in (None, "", []))


def message_region(messages: list[dict], k: int, text: str, render, facts: TemplateFacts, dropped: set) -> Span | None:
    """Where message k lies in `text` (the rendering of `messages`): the union of what changes when each of its
    fields changes; a field whose change renders the same text is dropped by the template (added to `dropped`)."""
    found = []
    for name in _fields(messages[k]):
        other = [*messages[:k], {**messages[k], name: altered(messages[k][name], facts.protected)}, *messages[k + 1 :]]
        span = changed(text, render(other))
        if span is None:
            dropped.add((k, name))
        else:
            found.append(span)
    return (min(s for s, _ in found), max(e for _, e in found)) if found else None


def check_order(regions: list[Span | None], roles: list[str], trained: list[int] | None = None) -> None:
    """The template shows each trained turn (all turns, for the probe) apart from every other message, those before
    it in the conversation before it and those after it after it: else its span cannot be told apart."""
    for k in range(len(regions)) if trained is None else trained:
        if regions[k] is None:
            continue
        for j, other in enumerate(regions):
            if other is None or j == k or (other[1] <= regions[k][0] if j < k else other[0] >= regions[k][1]):
                continue
            first, second = min(j, k), max(j, k)
            raise TurnError(
                f"the chat template renders messages[{second}] ({roles[second]}) inside or before "
                f"messages[{first}] ({roles[first]}), so the turns cannot be told apart for the labels; "
                "data.turn_rows=per_turn (each assistant turn its own row, ending with it) or data.loss_on=completion "
                "may part them, or give a template that renders each turn in order (data.chat_template)"
            )


def check_shown(regions: list[Span | None], messages: list[dict]) -> None:
    """The template shows every system, user and tool message it is given: one it leaves out (Phi-4's, OLMo 3's
    tool results) would train the answers without what they answer."""
    for k, (region, m) in enumerate(zip(regions, messages)):
        if region is None and m["role"] != "assistant" and m.get("content"):
            raise TurnError(
                f"the chat template renders nothing of messages[{k}] ({m['role']}), so the answers after it would "
                f"train without it; give a template that renders {m['role']} turns (data.chat_template) or leave it out"
            )


# ---- an assistant turn's trained span ----


def _header_end(text: str, lo: int, start: int, facts: TemplateFacts) -> int:
    """Where the model starts generating: after the generation prompt (or its longest part ending at a token or line,
    at least half of it) nearest before the turn; else after the plain turn's header; else at the turn."""
    prompt = facts.generation_prompt
    if prompt.strip():
        for cut in _prompt_cuts(prompt, facts):
            at = text.rfind(prompt[:cut], lo, start)
            if at >= 0:
                return at + cut
    if facts.header.strip() and text.startswith(facts.header, lo) and lo + len(facts.header) <= start:
        return lo + len(facts.header)
    last = None
    for match in facts.specials.finditer(text, lo, start) if facts.specials is not None else ():
        last = match.end()
    return last if last is not None else start


def _prompt_cuts(prompt: str, facts: TemplateFacts) -> list[int]:
    """The generation prompt whole, then its parts that end after a special token or a newline, longest first."""
    cuts = {len(prompt), *(k + 1 for k, c in enumerate(prompt) if c == "\n")}
    if facts.specials is not None:
        cuts.update(m.end() for m in facts.specials.finditer(prompt))
    return sorted((c for c in cuts if 2 * c >= len(prompt) and prompt[:c].strip()), reverse=True)


def _closing_special(text: str, start: int, end: int, hi: int, facts: TemplateFacts) -> int:
    """After the first special token past the turn that its own text does not use (Gemma 4 quotes a tool call's
    strings with <|"|>; its <tool_call|> closes it); else the turn's end."""
    inside = {m.group() for m in facts.specials.finditer(text, start, end)} if facts.specials is not None else set()
    for match in facts.specials.finditer(text, end, hi) if facts.specials is not None else ():
        if match.group() not in inside:
            return match.end()
    return end


def _turn_end(text: str, start: int, end: int, hi: int, facts: TemplateFacts) -> int:
    """After the first token that ends a plain turn between the turn's own text and the next message's (so a tool
    call's closing tokens before it are the turn's); else after the first special token there; else the turn's end."""
    match = facts.ends.search(text, end, hi) if facts.ends is not None else None
    if match is None:
        return _closing_special(text, start, end, hi, facts)
    at = match.end()
    while at < hi and (more := facts.ends.match(text, at, hi)):  # Cohere's <|END_RESPONSE|><|END_OF_TURN_TOKEN|>
        at = more.end()
    return at


def assistant_span(located: Located, k: int, facts: TemplateFacts) -> Span:
    """The characters assistant turn k trains: from its header's end to the end of the token that ends it."""
    regions = located.regions
    before = [r for r in regions[:k] if r is not None]
    after = [r for r in regions[k + 1 :] if r is not None]
    lo = max(e for _, e in before) if before else 0
    hi = min(a for a, _ in after) if after else len(located.text)
    start, end = regions[k]
    return _header_end(located.text, lo, start, facts), _turn_end(located.text, start, end, hi, facts)


def append_stop(located: Located, facts: TemplateFacts) -> None:
    """A last assistant turn the template ends with no special token (GLM's, whose turns end where the next role's
    token begins) gets that token appended and trained: the model learns to stop."""
    last = located.trained[-1] if located.trained else None
    if facts.stop is None or last is None or located.trained_turns[-1] != len(located.regions) - 1:
        return
    if last[1] == len(located.text.rstrip()) and facts.first_special(located.text, last[1], len(located.text)) is None:
        located.text = located.text[: last[1]] + facts.stop
        located.trained[-1] = (last[0], len(located.text))
        located.appended = facts.stop


def inline_reasoning(content) -> str | None:
    """The reasoning a turn's content holds inline (`<think>…</think>`), stripped; None without."""
    if not isinstance(content, str) or "</think>" not in content:
        return None
    return content.split("</think>")[0].split("<think>")[-1].strip() or None


def note_fields(located: Located, messages: list[dict]) -> None:
    """What each assistant turn carries (reasoning, tool calls) and which of it the template shows nothing of:
    a field whose change renders the same text, or inline reasoning that is not in the turn's rendered text."""
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        reasoning = [name for name in REASONING_FIELDS if m.get(name)]
        inline = inline_reasoning(m.get("content"))
        if reasoning or inline:
            located.carried.add((k, "reasoning"))
        if any((k, name) in located.dropped for name in reasoning):
            located.dropped.add((k, "reasoning"))
        region = located.regions[k]
        if inline and (region is None or inline not in located.text[region[0] : region[1]]):
            located.dropped.add((k, "reasoning"))
        if m.get("tool_calls"):
            located.carried.add((k, "tool_calls"))
        if m.get("content"):  # Llama 3.1 and gpt-oss show a tool call's turn without its text
            located.carried.add((k, "content"))


def tagged_spans(indices: list[Span], located: Located) -> list[Span]:
    """`{% generation %}` spans of the trained turns: each span goes to the assistant turn whose text it holds."""
    out = []
    for k in located.trained_turns:
        start, end = located.regions[k]
        out += [(a, b) for a, b in indices if a <= start and end <= b or start <= a < end]
    return out


def locate(
    messages: list[dict],
    trained: list[int],
    render: Callable[[list[dict]], str],
    facts: TemplateFacts,
    tagged: Callable[[list[dict]], tuple[str, list[Span]]] | None = None,
) -> Located:
    """The rendering of `messages` and the spans of the assistant turns `trained` (indices into messages)."""
    text, indices = tagged(messages) if facts.tagged and tagged is not None else (render(messages), None)
    located = Located(text, [])
    for k in range(len(messages)):
        located.regions.append(message_region(messages, k, text, render, facts, located.dropped))
    check_order(located.regions, [m["role"] for m in messages], trained)
    check_shown(located.regions, messages)
    note_fields(located, messages)
    for k in trained:
        if located.regions[k] is None:
            raise TurnError(
                f"the chat template renders nothing of messages[{k}] (assistant: "
                f"{', '.join(n for j, n in sorted(located.dropped) if j == k)} dropped), so it has nothing to train "
                "on; give a template that renders it (data.chat_template) or leave the turn out"
            )
        located.trained_turns.append(k)
    if indices is not None:
        located.trained = tagged_spans(indices, located)
    else:
        located.trained = [assistant_span(located, k, facts) for k in located.trained_turns]
        append_stop(located, facts)
    return located
