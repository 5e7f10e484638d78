"""Text rows or image+text rows: what differs between them (how rows are read and loaded, the tokenizer the text
collators take, the collator around them), chosen once per run from the model (finetune/assemble.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.data.image_inputs import ImageInputs
from finetune.data.sources import read_records
from finetune.data.text import load_sft_dataset
from finetune.data.vision import VisionCollator, load_vision_dataset, vision_records


@dataclass(frozen=True)
class RowKind:
    name: str
    images: bool
    read: Callable  # (DataConfig, DataReport) -> the raw records of data.source
    load: Callable  # (DataConfig, tokenizer, records=None) -> (datasets.Dataset, DataReport)
    text_tokenizer: Callable[[Any], Any]  # the tokenizer inside what the run loads (a VLM's: its processor's)
    collator: Callable[[Callable, Any], Callable]  # (the text collator, the tokenizer or processor) -> the collator


def _same(tokenizer):
    return tokenizer


def _text_collator(collator: Callable, tokenizer) -> Callable:
    return collator


TEXT_ROWS = RowKind("text", False, read_records, load_sft_dataset, _same, _text_collator)


def image_text_rows(inputs: ImageInputs) -> RowKind:
    """Image+text rows for a VLM whose forward takes `inputs` beside the rows (token types, packed rope positions)."""

    def collator(text_collator: Callable, processor) -> Callable:  # the processor's image tensors join each batch
        return VisionCollator(text_collator, processor, inputs)

    def tokenizer_of(processor):
        return processor.tokenizer

    return RowKind("image+text", True, vision_records, load_vision_dataset, tokenizer_of, collator)
