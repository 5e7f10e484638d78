"""Image+text rows for a VLM recipe: read, check the images, render through the processor's chat template, label.

`load_vision_dataset(data, processor)` returns a `datasets.Dataset` with `input_ids`, `labels` (-100 on the prompt,
the image tokens and everything but the assistant's turns; not shifted), `images` (references: a path or encoded
bytes, opened again by the collator so pixels never sit in the dataset), `row` (where the row came from) and `length`,
plus the `DataReport`.

Rows: `messages` and `images` (a list) or `image` (one), from jsonl/json/parquet/csv files (image paths relative
to the file), hub datasets (PIL/encoded images), or the built-in `shapes_captions`. A message's content is a string or
a list of parts ({"type": "image"}, {"type": "text", "text": …}); the image token inside a text (LLaVA-style
"<image>\\n…") counts as a placeholder too; a row with images and no placeholder gets them at the start of its first
user turn. A row without images is a text row. The trained spans come from one rendering of the conversation
(finetune/data/chat_labels.py); the rendering goes through the processor, so placeholders are expanded exactly as at
inference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.core.labels import IGNORE_INDEX, target_count
from finetune.data.chat_labels import Offsets, check_labels, conversation_rows, render, token_labels
from finetune.data.chat_templates import require_chat_template
from finetune.data.formats import check_text, detect_format
from finetune.data.image_inputs import ImageInputs
from finetune.data.images import image_base_dir, open_image, stored_image, stored_ref
from finetune.data.messages import CHAT_ROLES, check_turns
from finetune.data.report import DataReport
from finetune.data.sources import BadRow, Record, read_records, reject_row
from finetune.recipe import DataConfig, RecipeError, first_line

EXTRA_COLUMNS = ("images", "row", "length")  # what the collator takes off before the text collator pads
IMAGE_TOKEN_NAMES = (
    "image_token",
    "fake_image_token",
    "global_image_token",
    "boi_token",
    "eoi_token",
    "image_start_token",
    "image_end_token",
    "vision_start_token",
    "vision_end_token",
)


# ---- rows ----


def _parts(content: Any, what: str) -> list[dict]:
    if isinstance(content, str):
        if not content.strip():
            raise BadRow(f"{what} is empty")
        check_text(content, what)
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise BadRow(f"{what} is neither a string nor a non-empty list of parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            check_text(part["text"], f"{what}[{k}].text")
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise BadRow(f"{what}[{k}] is not an {{type: image}} or {{type: text, text}} part")
    return parts


def parse_vision_row(record: Any, image_token: str) -> tuple[list[dict], list[Any]]:
    """(messages with list contents, image references), placeholders checked against the images."""
    if not isinstance(record, dict) or "messages" not in record:
        raise BadRow("a row is an object with messages (and images/image)")
    images = record.get("images", record.get("image"))
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRow("messages is not a non-empty list of messages")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise BadRow(f"messages[{k}] is not a {{role, content}} message")
        out.append({"role": m["role"], "content": _parts(m["content"], f"messages[{k}].content")})
    check_turns(out, CHAT_ROLES, "messages")  # known roles, alternating, as for text rows
    placeholders = sum(1 if p["type"] == "image" else p["text"].count(image_token) for m in out for p in m["content"])
    if images and not placeholders:
        first_user = next((m for m in out if m["role"] == "user"), None)
        if first_user is None:
            raise BadRow("the row has images but no user turn to put them in")
        first_user["content"] = [{"type": "image"} for _ in images] + first_user["content"]
    elif placeholders != len(images):
        raise BadRow(
            f"messages hold {placeholders} image placeholder(s) ({image_token} or {{type: image}}) but the "
            f"row has {len(images)} image(s)"
        )
    return out, images


def image_token_ids(processor) -> set[int]:
    tokenizer = processor.tokenizer
    tokens = [getattr(processor, name, None) for name in IMAGE_TOKEN_NAMES]
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokens if isinstance(t, str) and t}
    return {i for i in ids if i is not None and i != tokenizer.unk_token_id}


def _processed(processor, text: str, images: list) -> list[int]:
    """The processor's ids of one rendering: its placeholders expanded (as at inference) with the images they hold."""
    count = text.count(getattr(processor, "image_token", "<image>"))
    try:
        out = processor(text=[text], images=images[:count] or None, add_special_tokens=False)
    except (ValueError, TypeError) as e:
        raise BadRow(f"the processor refuses it ({first_line(e)})") from None
    return list(out["input_ids"][0])


def expand_labels(text_ids: list[int], text_labels: list[int], ids: list[int]) -> list[int]:
    """The labels of the processor's `ids` from those of the tokenizer's `text_ids` of the same rendering: the
    processor only inserts tokens at the image placeholders (its image tokens, never targets), so the two walk
    together and what it inserted is IGNORE_INDEX. BadRow where they do not (a processor that rewrites text)."""
    labels, k = [], 0
    for token in ids:
        if k < len(text_ids) and token == text_ids[k]:
            labels.append(text_labels[k])
            k += 1
        else:
            labels.append(IGNORE_INDEX)
    if k < len(text_ids):
        raise BadRow("the processor tokenizes the rendering differently from its tokenizer, so labels cannot follow")
    return labels


def encode_row(processor, messages: list[dict], images: list, data: DataConfig) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each training row of one conversation: rendered once (finetune/data/chat_labels.py
    finds its trained spans and labels the tokenizer's tokens), then through the processor, whose image tokens the
    labels skip."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns = [] if data.loss_on == "all" else turns[-1:] if data.loss_on == "completion" else turns
    if data.loss_on != "all" and not turns:
        raise BadRow("no assistant turn to learn from")
    require_chat_template(processor)
    if data.loss_on == "all":
        ids = _processed(processor, render(processor, messages), images)
        return [(ids, list(ids))]
    rows = []
    for located in conversation_rows(processor, messages, turns, data.turn_rows):
        text = processor.tokenizer(located.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = Offsets(text["offset_mapping"])
        text_labels = token_labels(text["input_ids"], offsets, located.trained)
        check_labels(located, offsets, text_labels)
        ids = _processed(processor, located.text, images)
        rows.append((ids, expand_labels(text["input_ids"], text_labels, ids)))
    return rows


def vision_records(data: DataConfig, report: DataReport) -> list[Record]:
    """The raw image+text rows of data.source (the first data.limit), each with where it came from."""
    if data.source == "shapes_captions":
        from finetune.data import shapes_captions

        records = [(f"shapes_captions row {k + 1}", r) for k, r in enumerate(shapes_captions.rows(data.limit))]
        report.rows_read = len(records)
        return records
    records = read_records(data, report)
    if data.format not in ("auto", "messages"):
        raise RecipeError(f"data.format={data.format}: a VLM recipe reads messages rows (with images/image)")
    detect_format("messages", records, data.source)
    return records


def load_vision_dataset(data: DataConfig, processor, records: list[Record] | None = None):
    """(datasets.Dataset with input_ids, labels, images, row; DataReport), from data.source or from `records` already
    read (finetune/data/training_set.py splits them into training and held-out rows)."""
    report = DataReport(source=data.source, format="messages+images")
    if records is None:
        records = vision_records(data, report)
    else:
        report.rows_read = len(records)
    image_ids = image_token_ids(processor)
    image_token = getattr(processor, "image_token", "<image>")
    columns: dict[str, list] = {"input_ids": [], "labels": [], "images": [], "row": [], "length": []}
    for where, record in records:
        base = image_base_dir(where)
        try:
            messages, refs = parse_vision_row(record, image_token)
            opened = open_images(refs, base)
            rows = encode_row(processor, messages, opened, data)
        except BadRow as e:
            reject_row(data, report, where, str(e))
            continue
        for ids, labels in rows:
            labels = [IGNORE_INDEX if t in image_ids else label for t, label in zip(ids, labels)]
            fitted = fit_length(data, where, ids, labels, image_ids, report)
            if fitted is not None:
                add_row(columns, report, where, fitted, [stored_image(r, i, base) for r, i in zip(refs, opened)])
    report.rows_kept = len(columns["input_ids"])
    if not report.rows_kept:
        raise RecipeError(f"data.source={data.source}: no rows left ({report.summary()})")
    return vision_dataset(columns), report


def add_row(columns: dict[str, list], report: DataReport, where: str, row: tuple[list, list], images: list) -> None:
    """One labelled row into the dataset's columns, counted; a row without targets dropped and counted."""
    ids, labels = row
    targets = target_count(labels)
    if not targets:
        report.dropped_no_supervised_tokens += 1
        return
    columns["input_ids"].append(ids)
    columns["labels"].append(labels)
    columns["images"].append(images)
    columns["row"].append(where)
    columns["length"].append(len(ids))  # length_grouped: given a processor, Trainer would measure pixel_values
    report.tokens += len(ids)
    report.target_tokens += targets


def open_images(refs: list, base: Path | None) -> list:
    opened = []
    for k, ref in enumerate(refs, 1):
        try:
            opened.append(open_image(ref, base))
        except BadRow as e:
            raise BadRow(f"image {k} of {len(refs)}: {e}") from None
    return opened


def fit_length(data: DataConfig, where: str, ids: list, labels: list, image_ids: set[int], report: DataReport):
    """(ids, labels) within data.max_length per data.truncation, or None (dropped, counted). A cut never goes
    through an image's tokens: an image that does not fit is an error naming the row (data.truncation=drop drops)."""
    if len(ids) <= data.max_length:
        return ids, labels
    if data.truncation == "error":
        raise RecipeError(
            f"{where}: {len(ids)} tokens, longer than data.max_length={data.max_length}; raise "
            "data.max_length or set data.truncation=right (cut) or drop"
        )
    if data.truncation == "drop":
        report.dropped_over_length += 1
        return None
    last_image = max((i for i, t in enumerate(ids) if t in image_ids), default=-1)
    if last_image >= data.max_length:
        raise RecipeError(
            f"{where}: its image tokens end at token {last_image + 1}, past data.max_length={data.max_length} "
            "(an image's tokens cannot be cut); raise data.max_length or set data.truncation=drop"
        )
    report.truncated += 1
    return ids[: data.max_length], labels[: data.max_length]


def vision_dataset(columns: dict[str, list]):
    import datasets

    features = datasets.Features(
        {
            "input_ids": [datasets.Value("int32")],
            "labels": [datasets.Value("int32")],
            "images": [{"bytes": datasets.Value("binary"), "path": datasets.Value("string")}],
            "row": datasets.Value("string"),
            "length": datasets.Value("int32"),
        }
    )
    return datasets.Dataset.from_dict(columns, features=features)


# ---- batches ----


class VisionCollator:
    """Wraps the text collator batching.prepare chose (padding, packing, micro-batch items): it pads the text columns,
    this adds the image processor's tensors (pixel_values, …) for the batch's images, in row order, and what else
    the model's forward takes (`inputs`: token types, a packed row's multimodal rope positions)."""

    def __init__(self, text_collator, processor, inputs: ImageInputs | None = None):
        self.text_collator, self.image_processor = text_collator, processor.image_processor
        self.inputs = inputs or ImageInputs()

    def __call__(self, items: list):
        nested = bool(items) and isinstance(items[0], list)  # token-budget batching: items are whole micro-batches
        groups = items if nested else [items]
        rows = [row for group in groups for row in group]
        images = []
        for row in rows:
            try:
                images.append([open_image(stored_ref(ref)) for ref in row["images"]])
            except BadRow as e:
                raise RecipeError(f"{row['row']}: {e}") from None
        text = [[{k: v for k, v in r.items() if k not in EXTRA_COLUMNS} for r in group] for group in groups]
        batch = self.text_collator(text if nested else text[0])
        if any(images):  # in row order: a packed row's image tokens meet its images' features in the same order
            pixels = self.image_processor(images, return_tensors="pt")
            batch.update({k: v for k, v in pixels.items() if isinstance(v, torch.Tensor)})
        return self.inputs.add_to(batch)
