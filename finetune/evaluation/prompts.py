"""The prompts a run generates samples from at each evaluation, ready as model inputs.

`eval.samples` fixed held-out rows, spread over the eval set: a chat row's conversation up to its first assistant
turn (rendered with the generation prompt, images included) with that turn as the reference; a text row's first
third, the rest as the reference. Then the recipe's own `eval.prompts`, each as one user turn (raw text where the
tokenizer has no chat template).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.data.images import image_base_dir, open_image
from finetune.data.sources import BadRow, Record
from finetune.data.text import parse_row, render_chat
from finetune.data.vision import parse_vision_row


@dataclass
class SamplePrompt:
    name: str  # "held out 1", "prompt 1"
    shown: str  # the prompt as the console and the W&B table show it
    reference: str  # the held-out answer; "" for the recipe's own prompts
    inputs: dict[str, Any]  # input_ids, attention_mask (+ pixel_values, …): [1, T] CPU tensors


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return " ".join("[image]" if p.get("type") == "image" else p.get("text", "") for p in parts).strip()


def _spread(count: int, total: int) -> list[int]:
    """Indices of `count` rows spread evenly over `total`, then every other row (to replace rows that cannot be
    used)."""
    first = list(dict.fromkeys(round(k * total / count) for k in range(count))) if count else []
    return first + [i for i in range(total) if i not in set(first)]


def _encode(tokenizer, vision: bool, text: str, images: list, special_tokens: bool) -> dict:
    import torch

    if vision:
        out = tokenizer(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    ids = tokenizer(text, add_special_tokens=special_tokens)["input_ids"]
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


def _held_out(where: str, record: Any, fmt: str, tokenizer, vision: bool) -> tuple[str, str, dict]:
    """(shown, reference, inputs) of one held-out row; BadRow when it has nothing to prompt with."""
    if fmt == "text":
        text = parse_row("text", record, "all")[0]
        cut = text.find(" ", len(text) // 3)
        if cut <= 0:
            raise BadRow("too short to prompt with")
        return text[:cut], text[cut:].strip(), _encode(tokenizer, False, text[:cut], [], True)
    if vision:
        image_token = getattr(tokenizer, "image_token", "<image>")
        messages, refs = parse_vision_row(record, image_token)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    else:
        messages, turns = parse_row(fmt, record, "assistant")
    if not turns or turns[0] == 0:
        raise BadRow("no prompt before an assistant turn")
    prompt = messages[: turns[0]]
    text = render_chat(tokenizer, prompt, True)
    images = []
    if vision:
        base = image_base_dir(where)
        images = [open_image(ref, base) for ref in refs][: text.count(getattr(tokenizer, "image_token", "<image>"))]
    users = [m for m in prompt if m["role"] == "user"] or prompt
    return (
        _text_of(users[-1]["content"]),
        _text_of(messages[turns[0]]["content"]),
        _encode(tokenizer, vision, text, images, False),
    )


def sample_prompts(
    records: list[Record], fmt: str, count: int, own: list[str], tokenizer, vision: bool
) -> list[SamplePrompt]:
    """`count` held-out rows of `records` (of format `fmt`) and the prompts `own`, as SamplePrompts."""
    prompts = []
    for index in _spread(min(count, len(records)), len(records)):
        if len(prompts) == count:
            break
        where, record = records[index]
        try:
            shown, reference, inputs = _held_out(where, record, fmt, tokenizer, vision)
        except BadRow:
            continue
        prompts.append(SamplePrompt(f"held out {len(prompts) + 1}", shown, reference, inputs))
    for k, text in enumerate(own, 1):
        if getattr(tokenizer, "chat_template", None):
            content = [{"type": "text", "text": text}] if vision else text
            rendered, special = render_chat(tokenizer, [{"role": "user", "content": content}], True), False
        else:
            rendered, special = text, True
        prompts.append(SamplePrompt(f"prompt {k}", text, "", _encode(tokenizer, vision, rendered, [], special)))
    return prompts
