"""Per-sequence attention for packed rows: torch sdpa with `is_causal` on each sequence's slice of the row.

A packed row (`data.batching: packed`) holds several sequences whose position_ids restart at each one. Under `sdpa`,
transformers builds a block-diagonal causal mask from the position_ids and attends over the whole row (T_row² work,
mostly masked, and no fused causal kernel). `packed_sdpa` (registered in transformers' AttentionInterface) attends
within each sequence instead: Σ T_i² work, no mask, the same numbers. `finetune.assemble.build` switches a text model,
or a VLM's language model (its vision tower keeps its own attention), from `sdpa` to it for packed rows once a small
packed probe shows the same logits as sdpa's (a start-up line says which ran). Other implementations (flash_attention_2
runs varlen from the collator's `cu_seq_lens_q/k` already) are left alone.

On CUDA the per-sequence loop is launch-bound, so a packed row there goes to one varlen kernel call per layer (torch's
`varlen_attn`, finetune/model/varlen_attention.py) fed by the bounds the collator made once per micro-batch. Where that
kernel is missing (torch < 2.10: one warning) or cannot take a call (float32 without autocast, attention dropout, no
bounds from the collator: one warning per reason), the loop runs: the same numbers, slower.

Its mask function returns no mask only for a causal call without a padding mask, sliding window, chunk, overlay or
KV-cache offset (a plain or a packed row); every other call gets sdpa's mask and runs as sdpa.
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.utils import logging

from finetune.model.packed_probe import NAME, packed_row_error, probe_error
from finetune.model.varlen_attention import VarlenKernel, torch_varlen_attn
from finetune.recipe import RecipeError

logger = logging.get_logger(__name__)


# (weakref to the position_ids or cu_seq_lens tensor, its version, the bounds read from it): every layer of one forward
# is handed the same tensor, so the host reads the boundaries once per forward rather than once per layer.
_bounds_cache: tuple = (None, -1, None)


def cached_bounds(tensor: torch.Tensor, read) -> list[list[tuple[int, int]]]:
    global _bounds_cache
    ref, version, bounds = _bounds_cache
    if ref is None or ref() is not tensor or tensor._version != version:
        bounds = read(tensor)
        _bounds_cache = (weakref.ref(tensor), tensor._version, bounds)
    return bounds


def row_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """[(start, end) of each sequence] per row; a sequence starts where the position does not follow the previous
    one by 1 (the rule transformers' `find_packed_sequence_indices` uses for the mask this replaces)."""
    starts = torch.ones(position_ids.shape, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    length = position_ids.shape[1]
    per_row: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
    for row, t in starts.nonzero().tolist():  # one host read per forward
        per_row[row].append(t)
    return [list(zip(s, s[1:] + [length])) for s in per_row]


def cumulative_bounds(cu_seq_lens: torch.Tensor, keys: torch.Tensor | None = None) -> list[list[tuple]] | None:
    """The one row's bounds from cu_seq_lens; None where the keys' cu_seq_lens differ (position_ids decide then)."""
    if keys is not None and keys is not cu_seq_lens:
        if keys.shape != cu_seq_lens.shape:
            return None
        edges, key_edges = torch.stack([cu_seq_lens, keys.to(cu_seq_lens)]).tolist()  # one host read for both
        if edges != key_edges:
            return None
    else:
        edges = cu_seq_lens.tolist()
    return [list(zip(edges[:-1], edges[1:]))]


def sequence_bounds(batch: int, length: int, kwargs: dict) -> list[list[tuple[int, int]]]:
    """Sequence bounds per row, from the flash-attention kwargs where a collator gave them, else from position_ids."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if batch == 1 and cu_q is not None:
        # the keys' bounds are compared inside the cached read: once per forward, not once per layer (on a GPU each
        # comparison is a host sync)
        bounds = cached_bounds(cu_q, functools.partial(cumulative_bounds, keys=cu_k))
        if bounds is not None:
            return bounds
    position_ids = kwargs.get("position_ids")
    if position_ids is None or position_ids.dim() != 2:
        raise RuntimeError(
            f"attention '{NAME}' needs the [batch, length] position_ids in the attention call to find the packed "
            "sequences; this model does not pass them: set model.attn_implementation=eager"
        )
    bounds = cached_bounds(position_ids, row_bounds)
    return bounds * batch if len(bounds) == 1 and batch > 1 else bounds  # position_ids [1, T] shared by the rows


def plain_causal(module, query, key, attention_mask, is_causal, kwargs) -> bool:
    """Whether a call is plain causal self-attention over whole rows (False: sdpa's path takes it); raises for what
    neither path computes."""
    length = query.shape[2]
    if attention_mask is not None or length != key.shape[2] or length == 1:
        return False
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise RuntimeError(f"attention '{NAME}' is causal only; this module is not ({type(module).__name__})")
    for name in ("softcap", "position_bias", "sliding_window"):
        if kwargs.get(name) is not None:
            raise RuntimeError(f"attention '{NAME}' does not support {name}; use model.attn_implementation=sdpa")
    return True


def packed_sdpa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention signature: query [B, H, T, d], key/value [B, H_kv, T, d] → ([B, T, H, d], None)."""
    length = query.shape[2]
    if not plain_causal(module, query, key, attention_mask, is_causal, kwargs):  # sdpa's path
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    bounds = sequence_bounds(query.shape[0], length, kwargs)
    if all(len(row) == 1 for row in bounds):  # one sequence per row: sdpa's own causal call
        return sdpa_attention_forward(
            module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    gqa = {}
    if groups > 1:  # sdpa's own choice: enable_gqa where its kernels take it unmasked (CUDA), else repeat once per row
        if use_gqa_in_sdpa(None, key, value):
            gqa["enable_gqa"] = True
        else:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    rows = []
    # split, not slices: the backward of a split concatenates the pieces' gradients, where each slice's would write
    # into a zero-filled tensor of the whole row
    for q, k, v, row in zip(query.split(1), key.split(1), value.split(1), bounds):
        lengths = [e - s for s, e in row]
        pieces = [
            torch.nn.functional.scaled_dot_product_attention(
                q_i, k_i, v_i, dropout_p=dropout, scale=scaling, is_causal=True, **gqa
            ).transpose(1, 2)  # [1, T_i, H, d]: concatenated along T the output is already in transformers' layout
            for q_i, k_i, v_i in zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2))
        ]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0), None


def packed_sdpa_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    use_vmap=False,
    **kwargs,
):
    """No mask for a plain causal row or a packed one (the attention splits it); sdpa's mask for anything else."""
    # `and_mask` without vmap is transformers' packed-sequence wrapper of the causal mask (custom and-masks use vmap)
    packed = getattr(mask_function, "__name__", None) == "and_mask" and not use_vmap
    causal = packed or (mask_function is causal_mask_function and allow_is_causal_skip)
    plain = attention_mask is None and local_size is None and "allow_is_bidirectional_skip" not in kwargs
    plain = plain and q_length == kv_length and isinstance(q_offset, int) and isinstance(kv_offset, int)
    if causal and plain and q_offset == kv_offset == 0:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        use_vmap=use_vmap,
        **kwargs,
    )


class PackedAttention:
    """The attention function registered as `packed_sdpa`: a packed row on the varlen kernel's device (CUDA) in one
    kernel call per layer (finetune/model/varlen_attention.py), every other call as `packed_sdpa_attention`. A call
    the kernel cannot take (float32 without autocast, attention dropout, no bounds from the collator, ...) runs per
    sequence, with one warning per reason."""

    def __init__(self, varlen: VarlenKernel | None = None):
        self.varlen = varlen
        self.warned: set[str] = set()

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        kernel = self.varlen
        if (
            kernel is not None
            and query.device.type == kernel.device
            and plain_causal(module, query, key, attention_mask, is_causal, kwargs)
        ):
            reason = kernel.why_not(query, dropout, kwargs)
            if reason is None:
                return kernel(query, key, value, scaling, kwargs), None
            cu = kwargs.get("cu_seq_lens_q")
            alone = cu is not None and cu.numel() <= 2  # one sequence: sdpa's own call either way, nothing to say
            if reason not in self.warned and not alone:
                self.warned.add(reason)
                logger.warning(
                    f"attention '{NAME}': packed rows on {kernel.device} run causal sdpa per sequence, "
                    f"not the varlen kernel: {reason}"
                )
        return packed_sdpa_attention(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )


def register(attention: PackedAttention | None = None, name: str = NAME) -> PackedAttention:
    """Register `attention` (default: with torch's varlen_attn where it can run) and its mask function as `name`."""
    if attention is None:
        fn = torch_varlen_attn()
        attention = PackedAttention(VarlenKernel(fn) if fn is not None else None)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, packed_sdpa_mask)
    return attention


def config_reason(config) -> str | None:
    """Why a model's attention is not plain causal everywhere (None: it is), from its config."""
    if not getattr(config, "is_causal", True):
        return "the model is not causal"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and set(layer_types) != {"full_attention"}:
        return f"layer types {sorted(set(layer_types))} need sdpa's mask"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention needs sdpa's mask"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention needs sdpa's mask"
    return None


def check_packed_row(model, attention: str, instead: str) -> None:
    """Refuse packed rows, in one line, where the model's own attention lets a packed row's sequences see one another
    or cannot run one (the packed probe: its logits against each sequence run alone); `instead`: the overrides that
    batch them otherwise (RunPlan.instead_of_packing)."""
    if why := packed_row_error(model):
        raise RecipeError(
            f"packed rows (data.batching or eval.batching=packed): {type(model).__name__} with attention {attention} "
            f"does not keep the sequences of a packed row apart: {why}; set {instead}"
        )


def use_for_packed_rows(model, instead: str) -> str:
    """Switch a text model (a VLM: its language model) on `sdpa` to `packed_sdpa` where a probe shows the same logits;
    the start-up line. `instead`: the way out where packing is refused (RunPlan.instead_of_packing)."""
    text = model.config.get_text_config()
    current = text._attn_implementation
    if current != "sdpa":
        if "flash" not in current:  # flash kernels: varlen from position_ids
            check_packed_row(model, current, instead)
        return f"attention: {current} (per-sequence packed attention replaces sdpa only)"
    attention = register()
    reason = config_reason(text) or probe_error(model)
    if reason is not None:  # sdpa stays: its block-diagonal mask must keep the row's sequences apart
        check_packed_row(model, current, instead)
        return f"attention: sdpa with a block-diagonal mask over each packed row (per-sequence attention: {reason})"
    text._attn_implementation = NAME
    if attention.varlen is None and torch.cuda.is_available():
        logger.warning(
            f"attention '{NAME}': torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn, so packed "
            "rows on CUDA run causal sdpa per sequence and layer; torch>=2.10 runs one varlen kernel per layer, as "
            "does model.attn_implementation=flash_attention_2 where flash-attn is installed"
        )
    on_cuda = "; on CUDA one varlen_attn call per layer" if attention.varlen is not None else ""
    return (
        f"attention: {NAME}, causal sdpa on each sequence of a packed row{on_cuda} (finetune/model/packed_attention.py)"
    )
