"""Host syncs of a training run counted on any device, a CPU included: the ops that block the host on CUDA.

On a GPU, torch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) names every call that waits for the
device. A CPU has no device to wait for, so `HostSyncs` models one: the model's parameters and buffers and every
batch after the trainer's `_prepare_inputs` are "on the device", and so is every tensor an op computes from one of
them (a `TorchDispatchMode` follows the whole run, backward and optimizer included) and every tensor made with the
device's `torch.device` (`torch.arange(n, device=x.device)`). Host tensors (the collated batch
before it moves, counts built on the host) stay off it, as they do on CUDA.

An op on a device tensor counts as a sync where CUDA's would block the host:

- `aten._local_scalar_dense`: `.item()`, `bool()`, `int()`, `float()` of a tensor (also `if tensor:` and `allclose`);
- `aten.nonzero`, `aten.masked_select`, `aten.unique*`, `aten.equal`, `aten.repeat_interleave` without
  `output_size`, `aten.bincount`: their output size or value is read back;
- `aten.index` / `aten.index_put(_)` with a boolean index (transformers' `hidden_states[bool mask]` and its backward),
  except a mask fill from a host scalar (CUDA's masked_fill path);
- `Tensor.tolist()`, `.numpy()`, `.cpu()` (a blocking device-to-host copy).

It does not see `.to("cpu")` (on a CPU the device is the host: the same call as a move to the device), blocking
host-to-device copies of unpinned memory, or stream/device synchronize calls: on CUDA the trainer copies pinned
batches without blocking, and nothing on the training path calls synchronize. `paused()` leaves a stretch out: a
CPU stand-in for a CUDA kernel that reads nothing back (the varlen attention's).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
READ_BACK = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,
    aten.bincount.default,
}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPIES_TO_HOST = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
FACTORIES = {
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.tensor,
    torch.as_tensor,
    torch.linspace,
    torch.eye,
}


def step_counts(syncs: HostSyncs, warmup: int = 1) -> dict[int, int]:
    """{optimizer step: syncs} after the first `warmup` steps (the first allocates, probes and finds the head)."""
    return {k: n for k, n in sorted((k, n) for k, n in syncs.per_phase.items() if isinstance(k, int) and k > warmup)}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _bool_index(func, args, resident) -> bool:
    if func not in BOOL_INDEXED:
        return False
    indices = args[1]
    if not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return False
    if func is aten.index.Tensor:
        return True
    value, accumulate = args[2], len(args) > 3 and args[3]
    # CUDA fills a boolean mask from a host scalar without reading the mask (masked_fill_)
    return accumulate or value.numel() != 1 or value in resident


def _read_back(func, args, kwargs, resident) -> bool:
    if func in READ_BACK:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return _bool_index(func, args, resident)


class _Residency(TorchDispatchMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        resident = self.owner.resident
        on_device = any(t in resident for t in _tensors((args, kwargs)))
        if on_device and _read_back(func, args, kwargs, resident):
            self.owner.record(str(func.overloadpacket.__name__))
        out = func(*args, **kwargs)
        if on_device:
            for t in _tensors(out):
                resident[t] = True
        return out


class _HostCopies(TorchFunctionMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.owner.to_device(func, args, kwargs):
            self.owner.place(out)
        elif func in COPIES_TO_HOST and args and args[0] in self.owner.resident:
            self.owner.record(func.__name__)
            if isinstance(out, torch.Tensor) and out is args[0]:  # a CPU "copy" is the tensor itself: now a host one
                out = out.detach().clone()
        return out


class HostSyncs:
    """Counts the syncs a CUDA run would make (see the module docstring) while active (`with HostSyncs() as syncs:`).

    `place(*tensors_or_modules)` puts tensors on the modelled device; `phase` names the part of the run the next
    syncs belong to (an optimizer step's number: `per_phase`); `sites` names where each one came from (the last
    three frames outside torch)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.resident = WeakIdKeyDictionary()
        self.phase: object = None
        self.per_phase: Counter = Counter()
        self.sites: Counter = Counter()
        self.counting = True
        self._modes = (_HostCopies(self), _Residency(self))

    def place(self, *items) -> None:
        for item in items:
            if isinstance(item, torch.nn.Module):
                for t in [*item.parameters(), *item.buffers()]:
                    self.resident[t] = True
            else:
                for t in _tensors(item):
                    self.resident[t] = True

    def to_device(self, func, args, kwargs) -> bool:
        """Whether a call moves a tensor to the modelled device or makes one there: `.to(device)` with a
        `torch.device` (the trainer's `_prepare_input`, `.to(self.args.device)`), or a new tensor given such a
        `device=` (transformers' `torch.arange(n, device=inputs_embeds.device)` for positions). A device spelled "cpu"
        is the host (`torch.tensor(1.0, device="cpu")` in torch's optimizers): on a CPU only that spelling tells the
        two apart."""
        if func is torch.Tensor.to:
            target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        elif func in FACTORIES:
            target = kwargs.get("device")
        else:
            return False
        if isinstance(target, str):
            target = None if target == "cpu" else torch.device(target)
        return isinstance(target, torch.device) and target.type == self.device.type

    @contextlib.contextmanager
    def paused(self):
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

    def record(self, op: str) -> None:
        if not self.counting:
            return
        self.per_phase[self.phase] += 1
        frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))
        self.sites[f"{op} @ {where}"] += 1

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def train_counting(trainer, syncs: HostSyncs | None = None) -> HostSyncs:
    """Trains `trainer` with its syncs counted: its model, every batch it moves to its device and every tensor made
    there are on the modelled device, and each sync is counted under the optimizer step it belongs to (1-based: that
    step's micro-batches, update and logging; "epoch end" after an epoch's last step)."""
    from transformers import TrainerCallback

    syncs = syncs if syncs is not None else HostSyncs(trainer.args.device)
    syncs.place(trainer.model)

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            syncs.phase = state.global_step + 1

        def on_epoch_end(self, args, state, control, **kwargs):
            syncs.phase = "epoch end"  # the epoch's (and the run's) end: read-backs of its totals

    trainer.add_callback(Phases())
    with syncs:
        trainer.train()
    return syncs
