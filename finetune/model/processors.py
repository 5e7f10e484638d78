"""Processors that image fine-tuning can use without torchvision: transformers' Qwen-VL processors (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, …) take a video processor, and every video processor needs torchvision, so AutoProcessor fails
for them without it. `auto_processor` then builds the same processor class image-only: its image processor through
AutoImageProcessor (the PIL class without torchvision), its tokenizer, its chat template, no video processor. The
folder's video-processor config is kept and saved again with it, so a folder it writes loads with AutoProcessor
wherever torchvision is installed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from finetune.env import is_main_process

VIDEO = "video_processor"
VIDEO_CONFIG = "video_preprocessor_config.json"  # transformers' file name for a video processor's config


def auto_processor(folder: str, trust_remote_code: bool = False):
    """AutoProcessor.from_pretrained(folder), or, where it fails only for want of torchvision to build the video
    processor, the same class image-only (one line says videos are unavailable). Other failures raise as they are."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (AttributeError, ImportError, OSError, ValueError, TypeError):
        cls = video_processor_class(folder, trust_remote_code)
        if cls is None:
            raise
    processor = image_only(cls).from_pretrained(folder, trust_remote_code=trust_remote_code)
    if is_main_process():
        print(f"{cls.__name__}: images only, videos unavailable (torchvision is not installed)", flush=True)
    return processor


def video_processor_class(folder: str, trust_remote_code: bool = False):
    """The processor class of the folder's model type when it takes a video processor and torchvision, which every
    video processor needs, is missing; else None."""
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return None
    try:
        cls = PROCESSOR_MAPPING[type(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code))]
    except (KeyError, OSError, ValueError):
        return None
    return cls if VIDEO in cls.get_attributes() else None


@functools.cache
def image_only(cls):
    """`cls` without its video processor: the same name (saved as `cls`, so a folder it writes loads as `cls` where
    torchvision is installed) and the same __init__ (image_token, image_token_id, … set as usual); the video
    processor is left out of its sub-processors, so it is never checked, loaded, saved or called (videos=None)."""

    class ImageOnly(cls):
        video_config: dict | None = None  # the loaded folder's video-processor config, written again on save

        @classmethod
        def get_attributes(klass):
            return [a for a in super().get_attributes() if a != VIDEO]

        @classmethod
        def from_pretrained(klass, folder, **kwargs):
            processor = super().from_pretrained(folder, **kwargs)
            processor.video_config = read_video_config(folder)
            return processor

        def save_pretrained(self, save_directory, **kwargs):
            saved = super().save_pretrained(save_directory, **kwargs)
            if self.video_config is not None:
                write_video_config(save_directory, self.video_config)
            return saved

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    return ImageOnly


def read_video_config(folder) -> dict | None:
    """The video-processor config of a local folder or a cached hub folder (None where it has none)."""
    from transformers.utils import cached_file

    path = cached_file(str(folder), VIDEO_CONFIG, _raise_exceptions_for_missing_entries=False)
    return json.loads(Path(path).read_text()) if path else None


def write_video_config(folder, config: dict) -> None:
    Path(folder, VIDEO_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
