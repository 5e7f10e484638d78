"""What a window of micro-batches holds and how fast it went: tokens, sequences, throughput, padding, MFU, memory.

Counts are taken per rank when a window is prefetched and summed over the data-parallel ranks in the same
all-reduce as the label-token count, so every figure is global (the whole job), not one rank's.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Mapping

import torch
from transformers.trainer_utils import unwrap_peft_model

from finetune.core.heads import text_config_of
from finetune.core.loss import CAUSAL_LM, IGNORE_INDEX, targets_of
from finetune.core.router_balance import experts_of

# Fields of the per-window count vector, in order.
COUNTS = ("label_tokens", "real_tokens", "computed_tokens", "sequences")

# Logged figures that depend on the clock or the machine: they reach the console and W&B (every `on_log` callback)
# but not `trainer_state.json`'s log_history, which a resumed run must reproduce exactly.
TIMING_KEYS = ("real_tokens_per_s", "computed_tokens_per_s", "samples_per_s", "peak_mem_mb", "mfu")

# Dense peak TFLOP/s per GPU as (bf16, fp16, fp32 without TF32), by a substring of the device name (the longest
# that matches: "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" are not the SXM part "NVIDIA H100 80GB HBM3"). None: the GPU
# has no such tensor cores (V100 and T4 have no bf16).
PEAK_TFLOPS = {
    "H100": (989.0, 989.0, 67.0),
    "H100 PCIe": (756.0, 756.0, 51.0),
    "H100 NVL": (835.0, 835.0, 60.0),
    "H200": (989.0, 989.0, 67.0),
    "H200 NVL": (835.0, 835.0, 60.0),
    "GH200": (989.0, 989.0, 67.0),
    "A100": (312.0, 312.0, 19.5),
    "L40S": (362.0, 362.0, 91.6),
    "L40": (181.0, 181.0, 90.5),
    "L4": (121.0, 121.0, 30.3),
    "A10G": (70.0, 70.0, 31.2),
    "A10": (125.0, 125.0, 31.2),
    "RTX 4090": (165.0, 165.0, 82.6),
    "RTX 3090": (71.0, 71.0, 35.6),
    "V100": (None, 125.0, 15.7),
    "T4": (None, 65.0, 8.1),
    "B200": (2250.0, 2250.0, 80.0),
}
PRECISIONS = ("bf16", "fp16", "fp32")
HALF_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def batch_counts(batch: Mapping, kind: str = CAUSAL_LM) -> list[int]:
    """[label tokens, real tokens, computed tokens, sequences] of one collated micro-batch.

    Reads only what is there: token counts from `input_ids` (else the labels' shape), real tokens from a [B, T]
    `attention_mask`; a batch without labels has no label tokens.
    """
    has_labels = isinstance(batch.get("labels"), torch.Tensor) or isinstance(batch.get("shift_labels"), torch.Tensor)
    label_tokens = int((targets_of(batch, kind) != IGNORE_INDEX).sum()) if has_labels else 0
    tokens = batch.get("input_ids")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        tokens = batch.get("labels") if has_labels and batch.get("labels") is not None else None
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        return [label_tokens, 0, 0, 0]
    computed = tokens.numel()
    mask = batch.get("attention_mask")
    real = int(mask.sum()) if isinstance(mask, torch.Tensor) and mask.shape == tokens.shape else computed
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 3:  # [4, B, L] multimodal rope: the text row first
        positions = positions[0]
    packed = mask is None and isinstance(positions, torch.Tensor)
    sequences = int((positions == 0).sum()) if packed else tokens.shape[0]
    return [label_tokens, real, computed, sequences]


def window_counts(batches: list[Mapping], kind: str = CAUSAL_LM) -> list[int]:
    totals = [0] * len(COUNTS)
    for batch in batches:
        totals = [a + b for a, b in zip(totals, batch_counts(batch, kind))]
    return totals


def peak_memory_mb(reset: bool = False) -> float:
    """Peak memory of this process: CUDA allocations since the last reset (`reset`: the next call counts from now),
    else the resident set size's high-water mark since the process started (never reset here: scripts measure their
    own windows of it through /proc/self/clear_refs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = torch.cuda.max_memory_allocated() / 2**20
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def matmul_parameters(model: torch.nn.Module) -> int:
    """What a token multiplies by: the weights of every nn.Linear (the LM head included, embeddings and norms not)
    and, of a mixture of experts' fused expert weights (one 3-D tensor per layer and projection, not linear layers),
    the share its routing sends each token through (experts per token ÷ experts)."""
    linear = sum(
        getattr(m.weight, "ds_numel", m.weight.numel())  # ZeRO-3 partitions weights; ds_numel is the full size
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    shape = routed_experts(model)
    if shape is None:
        return linear
    weights = [p for name, p in model.named_parameters() if p.dim() == 3 and ".experts." in name]
    fused = sum(getattr(p, "ds_numel", p.numel()) for p in weights)
    experts, per_token = shape
    return linear + fused * per_token // experts


def routed_experts(model: torch.nn.Module) -> tuple[int, int] | None:
    """(routed experts, experts per token) of a mixture of experts, as its forward passes them to its balancing loss,
    else from its config under the family's name for them (DeepSeek-V3 and GLM-4-MoE: n_routed_experts); None for a
    dense model."""
    if (shape := experts_of(unwrap_peft_model(model))) is not None:
        return shape
    text = text_config_of(getattr(model, "config", None))
    per_token = getattr(text, "num_experts_per_tok", None)
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    experts = next((getattr(text, n) for n in names if isinstance(getattr(text, n, None), int)), None)
    return (experts, per_token) if experts and isinstance(per_token, int) else None


def flops_per_token(model: torch.nn.Module, sequence_length: float, matmul_params: int | None = None) -> float:
    """Training FLOPs per token, forward + backward: 6 × matmul parameters + 12 × layers × hidden × context for
    attention (PaLM, Chowdhery et al. 2022, appendix B); layers and hidden from the (text) config."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "num_hidden_layers", 0) or 0
    hidden = getattr(text, "hidden_size", 0) or 0
    if matmul_params is None:
        matmul_params = matmul_parameters(model)
    return 6.0 * matmul_params + 12.0 * layers * hidden * sequence_length


def model_flops_utilisation(model: torch.nn.Module, logs: dict, matmul_params: int, peak_flops: float) -> float:
    """MFU of a step's log line: the model FLOPs of its real tokens only (padding and skipped prompt logits count as
    waste) per second over the job's peak FLOP/s."""
    per_token = flops_per_token(model, logs["mean_sequence_tokens"], matmul_params)
    return logs["real_tokens_per_s"] * per_token / peak_flops


def compute_precision(bf16: bool, fp16: bool, model: torch.nn.Module) -> str:
    """The precision the matmuls run in: the autocast one if any, else the dtype that most weights are stored in
    (model.dtype=bfloat16 without autocast multiplies in bf16)."""
    if bf16 or fp16:
        return "bf16" if bf16 else "fp16"
    sizes: dict[torch.dtype, int] = {}
    for param in model.parameters():
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    return HALF_DTYPES.get(max(sizes, key=sizes.get), "fp32") if sizes else "fp32"


def device_peak_flops(
    precision: str, override_tflops: float | None = None, device_name: str | None = None
) -> float | None:
    """The device's dense peak FLOP/s for the precision (bf16, fp16 or fp32), from `override_tflops` or the table of
    `device_name` (default: this process's CUDA device); None if unknown."""
    if override_tflops:
        return override_tflops * 1e12
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            peak = PEAK_TFLOPS[key][PRECISIONS.index(precision)]
            return peak * 1e12 if peak else None
    return None


class WindowMeter:
    """Sums window counts between two log lines and turns them into rates."""

    def __init__(self):
        self.windows = 0
        self.totals = [0] * len(COUNTS)
        self.run_totals = dict.fromkeys(COUNTS, 0)  # since this process started training: the end-of-run table
        self.peak_mem_mb = 0.0  # the highest logged peak memory of this process
        self.since = time.perf_counter()

    def add(self, counts: list[int]) -> None:
        self.windows += 1
        self.totals = [a + b for a, b in zip(self.totals, counts)]
        for key, count in zip(COUNTS, counts):
            self.run_totals[key] += count

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (an evaluation, a save of the best model) is not training's: the next rates skip it."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.since += time.perf_counter() - started

    def drain(self) -> dict[str, float]:
        """The logged figures since the previous drain; resets."""
        now = time.perf_counter()
        elapsed = max(now - self.since, 1e-9)
        label, real, computed, sequences = self.totals
        logs = {}
        if self.windows:
            logs = {
                "window_label_tokens": label / self.windows,  # one window per logged step at log.every_steps=1
                "real_tokens_per_s": real / elapsed,
                "computed_tokens_per_s": computed / elapsed,
                "samples_per_s": sequences / elapsed,
                "padding_efficiency": real / computed if computed else 1.0,
                "mean_sequence_tokens": real / sequences if sequences else 0.0,
                "peak_mem_mb": peak_memory_mb(reset=True),  # this log window's peak on a GPU
            }
            self.peak_mem_mb = max(self.peak_mem_mb, logs["peak_mem_mb"])
        self.windows, self.totals, self.since = 0, [0] * len(COUNTS), now
        return logs


class RouterMeter:
    """A mixture of experts' router between two log lines, on the device until drained (no host sync per step): the
    balancing term the steps added (this rank's shares, summed per window) and each layer's top-k routing counts.
    Drained: `balance_loss`, the mean per optimizer step over the ranks; `expert_load`, the largest expert's share of
    routing ÷ the mean share in the layer where it is highest (1: even; a collapsing router grows it), and per layer
    `expert_load/layer_N`."""

    def __init__(self):
        self.windows = 0
        self.balance: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def open_window(self) -> None:
        self.windows += 1

    def add(self, share: torch.Tensor, counts: torch.Tensor) -> None:
        share = share.detach().double()
        self.balance = share if self.balance is None else self.balance + share
        self.counts = counts if self.counts is None else self.counts + counts

    def drain(self, accelerator) -> dict[str, float]:
        if self.balance is None:
            return {}
        balance, counts = self.balance / max(self.windows, 1), self.counts
        if accelerator.num_processes > 1:  # every rank logs the same figures: one collective each, at log time
            balance, counts = accelerator.reduce(balance, reduction="mean"), accelerator.reduce(counts, reduction="sum")
        load = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)).tolist()
        self.windows, self.balance, self.counts = 0, None, None
        return {
            "balance_loss": float(balance),
            "expert_load": max(load),
            **{f"expert_load/layer_{layer}": value for layer, value in enumerate(load)},
        }
