"""What a VLM's forward takes beside the token ids and the image processor's tensors, made on the host per batch.

- Token types: the Qwen-VL family and GLM-4V read `mm_token_type_ids` (image 1, video 2), Gemma3 `token_type_ids`
  (image 1); their processors set them from the token ids alone, and so does this.
- Packed rows of the multimodal-RoPE family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V): the model derives its three
  rope rows (temporal, height, width) from a whole row, so a packed row gets them here, sequence by sequence, from the
  model's own `get_rope_index` given that sequence alone and its images' grids: the numbers the model computes for the
  sequence run by itself. transformers reads `position_ids` of shape [4, B, L]: a text row restarting at every
  sequence (the attention and its mask keep the sequences apart by it) over the three rope rows.

Imports torch only: finetune/assemble.py makes an `ImageInputs` from what the model layer reads in the model's config
(finetune/model/image_rows.py `forward_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageInputs:
    type_ids_key: str | None = None  # the forward's token-type argument, if it has one
    type_of: dict[int, int] = field(default_factory=dict)  # token id → its type (text is 0)
    # the model's get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=…) → ([3, 1, L], deltas); None: 1-D
    rope_index: Callable | None = None

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        types = torch.zeros_like(input_ids)
        for token, kind in self.type_of.items():
            types[input_ids == token] = kind
        return types

    def add_to(self, batch: dict) -> dict:
        """`batch` (input_ids, and image_grid_thw where it has images) with the token types and, for a packed row of
        the multimodal-RoPE family, its [4, B, L] position_ids."""
        if self.type_ids_key is None:
            return batch
        types = self.token_types(batch["input_ids"])
        batch[self.type_ids_key] = types
        positions = batch.get("position_ids")
        if self.rope_index is not None and "attention_mask" not in batch and positions is not None:
            batch["position_ids"] = self.packed_positions(batch["input_ids"], types, positions, batch)
        return batch

    def packed_positions(self, input_ids, types, positions, batch) -> torch.Tensor:
        """[4, B, L]: the text positions over each sequence's own rope rows, sequence by sequence."""
        grids = batch.get("image_grid_thw")
        used = 0
        rope = torch.zeros((3, *input_ids.shape), dtype=positions.dtype)
        for row in range(input_ids.shape[0]):
            for start, end in sequence_bounds(positions[row]):
                ids, kinds = input_ids[row : row + 1, start:end], types[row : row + 1, start:end]
                images = image_count(kinds[0])
                grid = grids[used : used + images] if images else None
                used += images
                sequence, _ = self.rope_index(ids, kinds, image_grid_thw=grid)
                rope[:, row, start:end] = sequence[:, 0]
        if grids is not None and used != len(grids):
            raise ValueError(f"a packed row holds {used} images' tokens but the batch has {len(grids)} image grids")
        return torch.cat([positions.unsqueeze(0), rope], dim=0)


def sequence_bounds(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sequence of a packed row: a sequence starts where its position is 0."""
    starts = (positions == 0).nonzero().flatten().tolist()
    return list(zip(starts, [*starts[1:], positions.shape[0]]))


def image_count(types: torch.Tensor) -> int:
    """Images in one sequence: runs of image tokens (type 1), as get_rope_index groups them."""
    image = types == 1
    return int(image[0]) + int((image[1:] & ~image[:-1]).sum()) if image.numel() else 0
