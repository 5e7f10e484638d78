"""What labelling needs of a chat template, read once from a probe conversation (`read_template`): its generation
prompt, a plain assistant turn's header, the tokens that end a turn, the stop token a template like GLM's ends its
last turn without, and the markup a row's text keeps when altered (finetune/data/chat_spans.py uses them). Imports
only the standard library and chat_spans.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from finetune.data.chat_spans import (
    Span,
    TemplateFacts,
    TurnError,
    check_order,
    message_region,
    pattern_of,
    prefix_length,
)

# a template literal that is markup a row's text may hold (a tag, a control token, Qwen's /nothink), kept when altered
MARKUP = re.compile(r"[<>\[\]|]|^/\w+$")
LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

PROBE = [  # distinct words, so each turn can be found in the rendering
    {"role": "user", "content": "probe question one"},
    {"role": "assistant", "content": "probe answer one"},
    {"role": "user", "content": "probe question two"},
    {"role": "assistant", "content": "probe answer two"},
]


def template_markup(template: str) -> list[str]:
    """The template's string literals that are markup (tags, control tokens): a row's text keeps them when altered,
    so a template that looks for them (`'</think>' in content`) renders the altered row the same way."""
    found = []
    for match in LITERAL.finditer(template):
        text = match.group(1) if match.group(1) is not None else match.group(2)
        text = text.replace("\\n", "\n").replace("\\'", "'").replace('\\"', '"')
        if len(text.strip()) >= 2 and MARKUP.search(text.strip()):
            found.append(text.strip())
    return found


def read_template(
    template: str,
    render: Callable[[list[dict]], str],
    render_prompt: Callable[[list[dict]], str],
    specials: list[str],
    added: list[str],
) -> TemplateFacts:
    """A template's facts (`TemplateFacts`) from a probe conversation: `render` renders messages as they are,
    `render_prompt` with the generation prompt; `specials`: the tokenizer's special tokens; `added`: all its added
    tokens. TurnError where the probe's turns cannot be found (the template leaves out or reorders content)."""
    plain = render(PROBE[:1])
    prompted = render_prompt(PROBE[:1])
    facts = TemplateFacts(
        generation_prompt=prompted[prefix_length(prompted, plain) :],
        header="",
        specials=pattern_of(specials),
        protected=pattern_of([*added, *template_markup(template)]),
        tagged=bool(GENERATION_TAG.search(template)),
    )
    text = render(PROBE)
    regions = [message_region(PROBE, k, text, render, facts, set()) for k in range(len(PROBE))]
    missing = next((m["content"] for m, r in zip(PROBE, regions) if r is None), None)
    if missing is not None:
        raise TurnError(f"the template leaves out message content ('{missing}'); render each message's content")
    check_order(regions, [m["role"] for m in PROBE])
    windows = [text[regions[k - 1][1] : regions[k][0]] for k in (1, 3)]
    header = windows[0][: prefix_length(*windows)]
    between = facts.first_special(text, regions[1][1], regions[2][0])
    after_last = facts.first_special(text, regions[3][1], len(text))
    if between is None and after_last is None:
        raise TurnError(
            "the template ends an assistant turn with no special token of the tokenizer, so the model would never "
            "learn to stop; end each turn with one (the tokenizer's EOS or a turn-end token)"
        )
    stop = between.group() if between is not None and after_last is None else None
    return replace(facts, header=header, stop=stop, ends=_turn_ends(text, regions, facts, stop))


def _turn_ends(text: str, regions: list[Span], facts: TemplateFacts, stop: str | None) -> re.Pattern | None:
    """The tokens that end an assistant turn in the probe: those that close both its earlier and its last turn
    (Cohere's <|END_RESPONSE|><|END_OF_TURN_TOKEN|>); where the two end differently (gpt-oss: <|end|>, <|return|>),
    the first special token after each."""
    if facts.specials is None:
        return None
    earlier = {m.group() for m in facts.specials.finditer(text, regions[1][1], regions[2][0])}
    last = [m.group() for m in facts.specials.finditer(text, regions[3][1], len(text))]
    common = [t for t in last if t in earlier]
    if common:
        return pattern_of(common)
    first = [facts.first_special(text, a, b) for a, b in ((regions[1][1], regions[2][0]), (regions[3][1], len(text)))]
    return pattern_of(m.group() for m in first if m is not None and m.group() != stop)
