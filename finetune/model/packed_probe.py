"""The packed-row probe: whether `packed_sdpa` gives sdpa's logits on a small packed row of this model (checked once
at start-up by finetune/model/packed_attention.py before it switches a model to per-sequence attention)."""

from __future__ import annotations

import inspect

import torch

from finetune.recipe import first_line

NAME = "packed_sdpa"
PROBE_LENGTHS = (6, 1, 2, 5)  # a one-token and a two-token sequence: the edges of a per-sequence split


def probe_batch(model) -> dict:
    """A packed row of PROBE_LENGTHS sequences of in-vocabulary ids (no image placeholder), on the model's device."""
    vocab = model.get_input_embeddings().num_embeddings
    total = sum(PROBE_LENGTHS)
    device = next(model.parameters()).device
    ids = (torch.arange(total, device=device) * 7919 + 3) % max(vocab - 1, 1) + 1  # spread over the vocabulary
    for name in ("image_token_id", "image_token_index", "video_token_id"):  # a VLM would ask for image features
        special = getattr(model.config, name, None)
        if isinstance(special, int):
            ids = torch.where(ids == special, 1, ids)
    positions = torch.cat([torch.arange(n, device=device) for n in PROBE_LENGTHS]).unsqueeze(0)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # multimodal rope: [4, 1, T], text first
        positions = positions.expand(4, 1, -1)  # on text the three rope rows are its 1-D positions
    return {"input_ids": ids.unsqueeze(0), "position_ids": positions, "use_cache": False}


def probe_error(model) -> str | None:
    """Why `packed_sdpa` would not give sdpa's logits on a small packed row (None: it does, to rounding)."""
    batch = probe_batch(model)
    training = model.training
    text = model.config.get_text_config()  # a VLM's language model only: its vision tower keeps its own attention
    logits = {}
    try:
        model.eval()
        # random state untouched: resumes stay bitwise. CPU only (devices=[]): an eval forward draws no CUDA random
        # numbers, and forking the CUDA state would make a CUDA context on GPU 0 in every rank before accelerate
        # gives each rank its device.
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for implementation in ("sdpa", NAME):
                text._attn_implementation = implementation
                logits[implementation] = model(**batch).logits.float()
    except Exception as e:  # an architecture it does not fit: keep sdpa
        return f"{type(e).__name__}: {first_line(e)}"
    finally:
        text._attn_implementation = "sdpa"
        model.train(training)
    difference = logits_difference(model, logits[NAME], logits["sdpa"])
    return None if difference is None else f"its logits differ from sdpa's by {difference:.3g} on a packed probe row"


def logits_difference(model, logits: torch.Tensor, reference: torch.Tensor) -> float | None:
    """The largest difference of `logits` from `reference` where it is beyond rounding (None: the same)."""
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2  # 16-bit: rounding of its own
    difference = float((logits - reference).abs().max())
    return None if difference <= tolerance * max(float(reference.abs().max()), 1.0) else difference


def packed_row_error(model) -> str | None:
    """Why the model's own attention (not sdpa) would let the sequences of a packed row see one another: the probe
    row's logits against each of its sequences run alone (None: the same, to rounding). transformers derives a packed
    row's block-diagonal mask from its position_ids for most families, not for every one (gpt-oss builds its masks
    without them)."""
    batch = probe_batch(model)
    training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # as probe_error: random state untouched
            packed = model(**batch).logits.float()
            start, alone = 0, []
            for length in PROBE_LENGTHS:
                positions = batch["position_ids"][..., start : start + length]
                ids = batch["input_ids"][:, start : start + length]
                alone.append(model(input_ids=ids, position_ids=positions, use_cache=False).logits.float())
                start += length
    except Exception as e:  # an architecture the probe does not fit: said, not guessed
        return f"the packed probe row cannot run ({type(e).__name__}: {first_line(e)})"
    finally:
        model.train(training)
    difference = logits_difference(model, packed, torch.cat(alone, dim=1))
    return (
        None
        if difference is None
        else f"a packed probe row's logits differ from its sequences' run alone by {difference:.3g} (they attend to "
        "one another)"
    )
