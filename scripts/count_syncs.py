"""Host-device synchronisations per optimizer step of a recipe's training, counted by torch.profiler.

    python scripts/count_syncs.py [--steps 3] [--json syncs.json] recipe=recipes/debug.yaml train.precision=bf16 \
        data.batching=packed

The recipe trains (`finetune.assemble.build`, as `finetune/train.py` does; no checkpoints, W&B off) for 1 + --steps
optimizer steps under torch.profiler; the first step is its warm-up and left out (schedule wait=0, warmup=1,
active=--steps, stepped at every optimizer step's end). Two counts over the active steps, divided by --steps:

- CUDA: the runtime calls that block the host: cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize
  and the synchronous cudaMemcpy (an `.item()`, a `nonzero`, a blocking copy each make one). The figure the issue's
  bound is about: at most one per micro-batch plus three per optimizer step.
- on a CPU, the syncs a CUDA run would make, modelled by finetune/testing/host_syncs.py (the model and every batch
  moved to the device are "on the device"; `.item()`, `nonzero`, boolean-mask indexing, `.tolist()` of anything
  computed from them count): `modelled_syncs_per_step` over the steps after the first, and where each one is.
- ops that wait for the device when their input is on a GPU, counted on any device (on a CPU an upper bound):
  aten::_local_scalar_dense (`.item()`, `int()`, `bool()` of a tensor), aten::nonzero (boolean-mask indexing
  too), aten::masked_select, aten::unique*. A CPU proxy and an upper bound: it also counts reads of tensors that stay
  on the host in a GPU run (counts taken from the host batch), and sees neither blocking copies nor `.tolist()`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SYNCING_OPS = (
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
    "aten::unique_consecutive",
)


class SyncSites:
    """Where the syncs come from on CUDA: torch's sync debug mode warns at each synchronizing call once the warm-up
    step has ended; each warning's Python stack (its last three frames outside torch) is one site, counted."""

    def __init__(self) -> None:
        self.sites: Counter = Counter()
        self.active = False

    def start(self) -> None:
        if torch.cuda.is_available() and not self.active:
            self.active = True
            warnings.simplefilter("always")
            warnings.showwarning = self.record
            torch.cuda.set_sync_debug_mode("warn")

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:
        frames = [
            f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings" not in f.filename
        ]
        self.sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    def stop(self) -> dict:
        if self.active:
            torch.cuda.set_sync_debug_mode(0)
        return dict(self.sites.most_common(25))


def count(recipe_args: list[str], steps: int, kernels: str | None = None) -> dict:
    from transformers import TrainerCallback

    from finetune.assemble import build
    from finetune.recipe import load_config

    cfg = load_config(recipe_args)
    cfg.train.max_steps, cfg.train.save_steps, cfg.log.wandb_mode = 1 + steps, 0, "disabled"
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with tempfile.TemporaryDirectory(prefix="count-syncs-") as output_dir:
        cfg.train.output_dir = output_dir
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = build(cfg, evaluate=False)
        if not cuda:
            return modelled(trainer, steps, recipe_args)
        with torch.profiler.profile(activities=activities, schedule=schedule) as profiler:
            sites = SyncSites()

            def on_step_end(*_, **__) -> None:
                profiler.step()
                sites.start()

            stepper = type("ProfilerStep", (TrainerCallback,), {"on_step_end": on_step_end})
            trainer.add_callback(stepper())
            trainer.train()
    where = sites.stop()
    if kernels and cuda:  # the active steps' device time by op: where the MFU goes
        table = profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
        Path(kernels).write_text(table + "\n")
    counts = Counter(e.name for e in profiler.events())
    cuda_calls = {name: counts[name] for name in CUDA_SYNCS if counts[name]}
    ops = {name: counts[name] for name in SYNCING_OPS if counts[name]}
    micro_batches = trainer.args.gradient_accumulation_steps
    bound = micro_batches + 3  # the issue's: one per micro-batch plus three per optimizer step
    per_step = sum(cuda_calls.values()) / steps if cuda else None
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "steps": steps,
        "micro_batches_per_step": micro_batches,
        "cuda_syncs_per_step": per_step,
        "cuda_syncs": cuda_calls,
        "syncing_ops_per_step": sum(ops.values()) / steps,
        "syncing_ops": ops,
        "bound_per_step": bound,
        "within_bound": None if per_step is None else per_step <= bound,
        "recipe": recipe_args,
        "sync_sites_all_steps": where,
    }


def modelled(trainer, steps: int, recipe_args: list[str]) -> dict:
    """On a CPU: the syncs a CUDA run would make per optimizer step after the first (finetune/testing/host_syncs.py)."""
    from finetune.testing.host_syncs import step_counts, train_counting

    syncs = train_counting(trainer)
    per_step = step_counts(syncs)
    micro_batches = trainer.args.gradient_accumulation_steps
    mean = sum(per_step.values()) / max(len(per_step), 1)
    return {
        "device": "cpu (CUDA syncs modelled)",
        "cuda_syncs_per_step": None,  # no CUDA here: the modelled count below stands in
        "steps": len(per_step),
        "micro_batches_per_step": micro_batches,
        "modelled_syncs_per_step": mean,
        "modelled_syncs_by_step": per_step,
        "bound_per_step": micro_batches + 3,
        "within_bound": mean <= micro_batches + 3,
        "recipe": recipe_args,
        "sync_sites_all_steps": dict(syncs.sites.most_common(25)),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps counted, after one warm-up step")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--kernels", help="on CUDA, write the profiled steps' ops by device time here")
    parser.add_argument("recipe", nargs="+", help="recipe=FILE and key=value overrides, as finetune/train.py takes")
    args = parser.parse_args(argv)
    result = count(args.recipe, args.steps, args.kernels)
    cuda = result["cuda_syncs_per_step"]
    print(
        f"{result['device']}: {result['micro_batches_per_step']} micro-batches per optimizer step, "
        f"{result['steps']} steps counted"
    )
    if cuda is not None:
        print(
            f"CUDA host syncs per optimizer step: {cuda:.1f} (bound {result['bound_per_step']}: "
            f"{'within' if result['within_bound'] else 'ABOVE'}) {result['cuda_syncs']}"
        )
    if "modelled_syncs_per_step" in result:
        print(
            f"modelled CUDA host syncs per optimizer step: {result['modelled_syncs_per_step']:.1f} "
            f"(bound {result['bound_per_step']}) {result['modelled_syncs_by_step']}"
        )
        for site, n in result["sync_sites_all_steps"].items():
            print(f"  {n:4d}  {site}")
    else:
        print(f"syncing ops per optimizer step: {result['syncing_ops_per_step']:.1f} {result['syncing_ops']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
