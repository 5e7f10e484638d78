"""What scripts/benchmark.py measures with: peak memory, a step clock whose hooks never wait for the device, MFU.

The clock's forward hook and step callback run inside training: on CUDA they must not make the host wait for the GPU
(a sync there would slow the arm it measures). Token counts are read from tensor shapes (host metadata) or summed into
device-side counters; step ends are CUDA events; everything is read once, after the arm's last step.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import threading
import time
from pathlib import Path

import torch


def proc_status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def machine_busy() -> float:
    """CPU seconds all processes on the machine have run so far (user, nice, system, irq, softirq: /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


class PeakMemory:
    """Peak memory of one arm above its start, in MiB: CUDA allocations, or the process's resident set: its high-water
    mark (VmHWM, reset through /proc/self/clear_refs), or where that cannot be reset, VmRSS sampled every 2 ms."""

    def __init__(self, cuda: bool):
        self.cuda, self.sampler = cuda, None
        self.kind = "CUDA max_memory_allocated" if cuda else "CPU resident set (VmHWM)"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap pages, so the previous arm's stay out
        self.base = proc_status_kb("VmRSS") * 1024
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
        except OSError:
            self.kind = "CPU resident set (VmRSS sampled every 2 ms)"
            self.sampler = RssSampler()

    def peak_mb(self) -> float:
        if self.cuda:
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        peak = self.sampler.stop() if self.sampler else proc_status_kb("VmHWM")
        self.sampler = None
        return (peak * 1024 - self.base) / 2**20


class RssSampler(threading.Thread):
    """The largest VmRSS (KiB) seen until `stop()`."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = proc_status_kb("VmRSS"), threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, proc_status_kb("VmRSS"))

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, proc_status_kb("VmRSS"))


class Clock:
    """Counts computed and real tokens of every training micro-batch as the trainer receives it (the hand loop calls it
    per forward); `mark()` at the end of every optimizer step records wall time (and a CUDA event), CPU time and the
    counts. Nothing here waits for the device until `result()`."""

    def __init__(self, cuda: bool):
        self.cuda, self.computed = cuda, 0
        self.real = torch.zeros((), dtype=torch.int64, device="cuda" if cuda else "cpu")  # summed on the device
        self.real_on_host = 0
        self.matmul_params: int | None = None
        self.marks: list[tuple] = []
        self.mark()

    def __call__(self, module, args, kwargs):
        if not torch.is_grad_enabled():  # a call outside training (no gradients) trains on nothing: not counted
            return
        # what the trainer logs: real = attention-mask ones, or every position of a padding-free row
        tokens = kwargs.get("input_ids")
        if not isinstance(tokens, torch.Tensor):
            return
        self.computed += tokens.numel()  # the shape: host metadata, no sync
        mask = kwargs.get("attention_mask")
        if not (isinstance(mask, torch.Tensor) and mask.shape == tokens.shape):
            self.real += tokens.numel()
        elif self.cuda and mask.device.type == "cpu":
            self.real_on_host += int(mask.sum())  # a batch still on the host (ours waits there): no device copy
        else:
            self.real += mask.sum()  # stays on the device

    def mark(self, *_, **__) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append(
            (time.perf_counter(), time.process_time(), machine_busy(), event, self._real(), self.computed)
        )

    def _real(self) -> tuple[torch.Tensor, int]:
        return self.real.clone(), self.real_on_host

    def result(self, warmup: int) -> dict:
        if self.cuda:
            torch.cuda.synchronize()  # after the arm's last step: the one wait, outside training
        (t0, p0, b0, e0, r0, c0), (t1, p1, b1, e1, r1, c1) = self.marks[warmup], self.marks[-1]
        seconds = e0.elapsed_time(e1) / 1000 if self.cuda else t1 - t0
        cores = os.cpu_count() or 1
        others = max(0.0, (b1 - b0) - (p1 - p0)) / max((t1 - t0) * cores, 1e-9)  # of the machine's CPU time
        r0, r1 = int(r0[0]) + r0[1], int(r1[0]) + r1[1]
        return {
            "seconds": seconds,
            "cpu_seconds": p1 - p0,
            "real_tokens": r1 - r0,
            "computed_tokens": c1 - c0,
            "steps": len(self.marks) - 1 - warmup,
            "all_real": r1,
            "all_computed": c1,
            "others_cpu": others,
            "matmul_params": self.matmul_params,
        }

    def attach(self, trainer) -> None:
        from transformers import PrinterCallback, ProgressCallback, TrainerCallback

        from finetune.core.meter import matmul_parameters

        for quiet in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(quiet)
        trainer.add_callback(type("StepClock", (TrainerCallback,), {"on_step_end": self.mark})())
        # counted from each micro-batch as the trainer receives it: what a model's forward gets can differ (ours
        # trains right padding without its mask)
        train_step = trainer.training_step

        def counted_step(model, inputs, *args, **kwargs):
            self(model, (), inputs)
            return train_step(model, inputs, *args, **kwargs)

        trainer.training_step = counted_step
        self.matmul_params = matmul_parameters(trainer.model)


class Recording:
    """A collator that keeps what it returns (on the host, before the Trainer moves it): the batches an arm trained
    on, in order, for another arm to replay; no device copy inside the measured steps."""

    def __init__(self, collator, keys=("input_ids", "attention_mask", "labels")):
        self.collator, self.keys, self.batches = collator, keys, []

    def __call__(self, features):
        batch = self.collator(features)
        self.batches.append({k: batch[k].clone() for k in self.keys})
        return batch


def mfu(
    real_tokens_per_s: float,
    matmul_params: int | None,
    layers: int,
    hidden: int,
    mean_length: float,
    peak_flops: float | None,
) -> float | None:
    """Model FLOP utilisation of real tokens: (6 × matmul parameters + 12 × layers × hidden × mean sequence length)
    FLOPs per token (finetune.core.meter.flops_per_token's formula) × real tokens/s over the device's dense peak."""
    if not peak_flops or not matmul_params:
        return None
    return (6.0 * matmul_params + 12.0 * layers * hidden * mean_length) * real_tokens_per_s / peak_flops
