"""One varlen attention call per layer for a packed row, from the bounds the collator made once per micro-batch.

The packed collator (finetune/data/batching.py) sets what transformers' flash-attention path reads: `cu_seq_lens_q/k`
(int32 [n + 1], cumulative, from 0) and `max_length_q/k` (Python ints), built on the host with the batch and moved to
the device with it. `VarlenKernel` hands them to a varlen kernel, torch's `torch.nn.attention.varlen.varlen_attn` by
default: every sequence of the row in one kernel, nothing read back to the host. `packed_sdpa`
(finetune/model/packed_attention.py) calls it for packed rows on CUDA; a call it cannot take (`why_not`) runs causal
sdpa per sequence instead.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import repeat_kv

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # torch's flash kernels are 16-bit only
FLASH_MAX_HEAD_DIM = 256


def torch_varlen_attn() -> Callable | None:
    """torch's varlen_attn where this torch has it (2.10 on) and a CUDA device is present; else None."""
    if not torch.cuda.is_available():  # the import loads torch._dynamo: not worth it where it can never run
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=16)
def flash_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)  # flash kernels need Ampere or newer


class VarlenKernel:
    """A varlen attention function with torch's `varlen_attn` signature (q [T, H, d], k/v [T, H_kv, d], cu_seq_q,
    cu_seq_k, max_q, max_k), called causally on the inputs it takes: `device` type, `dtypes`, head size.

    torch 2.10 spells causal `is_causal=True` and has no `scale` or `enable_gqa`; later versions take
    `window_size=(-1, 0)`, `scale` and `enable_gqa`. A missing `scale` is folded into the query, a missing
    `enable_gqa` repeats the key/value heads."""

    def __init__(
        self,
        fn: Callable,
        device: str = "cuda",
        dtypes: tuple[torch.dtype, ...] = FLASH_DTYPES,
        max_head_dim: int = FLASH_MAX_HEAD_DIM,
    ):
        self.fn, self.device, self.dtypes, self.max_head_dim = fn, device, dtypes, max_head_dim
        parameters = inspect.signature(fn).parameters
        self.causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
        self.takes_scale, self.takes_gqa = "scale" in parameters, "enable_gqa" in parameters

    def dtype_for(self, query: torch.Tensor) -> torch.dtype:
        """The dtype the call runs in: autocast's where it is on (sdpa would run in it too), else the query's."""
        device = query.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype

    def why_not(self, query: torch.Tensor, dropout: float, kwargs: dict) -> str | None:
        """Why a call on the kernel's device goes to per-sequence sdpa (None: the kernel takes it). Host-side checks
        only: nothing is read from the device."""
        if kwargs.get("cu_seq_lens_q") is None or not isinstance(kwargs.get("max_length_q"), int):
            return "the batch has no cu_seq_lens_q/max_length_q (the packed collator sets them)"
        if query.shape[0] != 1:
            return f"{query.shape[0]} packed rows in one batch (the collator's bounds cover one row)"
        if dropout:
            return f"attention dropout {dropout} (the varlen kernel has none)"
        dtype = self.dtype_for(query)
        if dtype not in self.dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"attention in {str(dtype).removeprefix('torch.')} (the varlen kernel takes {names}: train in bf16)"
        head_dim = query.shape[-1]
        if head_dim > self.max_head_dim or head_dim % 8:
            return f"head size {head_dim} (the varlen kernel takes multiples of 8 up to {self.max_head_dim})"
        if self.device == "cuda" and not flash_capable(query.device.index or 0):
            return "a GPU older than Ampere (compute capability 8.0)"
        return None

    def __call__(self, query, key, value, scaling: float | None, kwargs: dict) -> torch.Tensor:
        """transformers' layout: query [1, H, T, d], key/value [1, H_kv, T, d] → [1, T, H, d]."""
        dtype = self.dtype_for(query)
        groups = query.shape[1] // key.shape[1]
        if not self.takes_gqa and groups > 1:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        extra = dict(self.causal)
        if self.takes_scale:
            extra["scale"] = scaling
        elif scaling is not None:  # the kernel's own scale is d^-1/2: scores are linear in the query
            query = query * (scaling * query.shape[-1] ** 0.5)
        if self.takes_gqa:
            extra["enable_gqa"] = key.shape[1] != query.shape[1]
        q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))  # [T, heads, d]
        cu_q = kwargs["cu_seq_lens_q"]
        cu_k = kwargs.get("cu_seq_lens_k")
        max_q = kwargs["max_length_q"]
        max_k = kwargs.get("max_length_k", max_q)
        out = self.fn(q, k, v, cu_q, cu_q if cu_k is None else cu_k, max_q, max_k, **extra)
        return out.unsqueeze(0)
