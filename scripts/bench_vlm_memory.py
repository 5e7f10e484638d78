"""Peak memory of a VLM recipe's training step with the vision tower frozen vs training, at the same batch.

    python scripts/bench_vlm_memory.py                       # recipes/vlm.yaml as it is
    python scripts/bench_vlm_memory.py model.vision_config.image_size=224 train.micro_batch_size=2

Each variant runs in its own fresh process (same recipe, same rows, same seed): two optimizer steps through
`finetune.assemble.build`, measured on the second (the optimizer state exists by then). Reported per variant:
- peak: the process's peak memory during that step (CUDA: max_memory_allocated; CPU: VmHWM, reset before the step);
- activations: the largest total of tensors autograd kept for backward in one micro-batch forward (weights excluded);
- in tower: the part of those kept while the vision tower ran (0 when frozen: it runs without autograd);
- tower grads: the bytes of the tower's parameter gradients at the optimizer step (0 when frozen);
and the frozen / training ratios, from this one run.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
TOWER = "model.vision_tower"


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class SavedTensors:
    """Bytes autograd keeps for backward in one micro-batch forward (weights excluded): all of them, and those kept
    while the vision tower runs; the largest of each over the measured forwards."""

    def __init__(self, model, tower):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.now: dict[int, int] = {}
        self.in_tower: dict[int, int] = {}
        self.inside = False
        self.max = self.max_tower = 0
        model.register_forward_pre_hook(self.start)
        model.register_forward_hook(self.end)
        tower.register_forward_pre_hook(lambda *_: setattr(self, "inside", True))
        tower.register_forward_hook(lambda *_: setattr(self, "inside", False))

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.weights:
            self.now[storage.data_ptr()] = storage.nbytes()
            if self.inside:
                self.in_tower[storage.data_ptr()] = storage.nbytes()
        return t

    def start(self, *_):
        self.now, self.in_tower = {}, {}

    def end(self, *_):
        self.max = max(self.max, sum(self.now.values()))
        self.max_tower = max(self.max_tower, sum(self.in_tower.values()))


class SecondStep(TrainerCallback):
    """Peak memory, saved tensors and the tower's gradient bytes over the second optimizer step."""

    def __init__(self, model, cuda: bool):
        tower = next(m for n, m in model.named_modules() if n.endswith("vision_tower"))
        self.saved, self.tower, self.cuda, self.result = SavedTensors(model, tower), tower, cuda, {}

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.result["before_mb"] = torch.cuda.memory_allocated() / 2**20
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back so the reset peak starts low
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
            self.result["before_mb"] = _rss_kb("VmRSS") / 1024
        self.saved.max = self.saved.max_tower = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, lambda t: t)
        self.hooks.__enter__()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 1:  # the window's gradients, before the optimizer step frees them
            grads = [p.grad for p in self.tower.parameters() if p.grad is not None]
            self.result["tower_grads_mb"] = sum(g.numel() * g.element_size() for g in grads) / 2**20

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 2:
            return
        self.hooks.__exit__(None, None, None)
        if self.cuda:
            torch.cuda.synchronize()
            self.result["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        else:
            self.result["peak_mb"] = _rss_kb("VmHWM") / 1024
        self.result["activations_mb"] = self.saved.max / 2**20
        self.result["tower_activations_mb"] = self.saved.max_tower / 2**20


def measure(overrides: list[str]) -> dict:
    """One variant, in this process: build the recipe's trainer, train two steps, measure the second."""
    from finetune.assemble import build
    from finetune.recipe import load_config

    trainer = build(load_config(overrides))
    cuda = torch.cuda.is_available()
    second = SecondStep(trainer.model, cuda)
    trainer.add_callback(second)
    trainer.train()
    result = second.result
    result.setdefault("tower_grads_mb", 0.0)
    result["trainable_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result["device"] = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    return result


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--variant":
        print("RESULT " + json.dumps(measure(argv[1:])), flush=True)
        return 0
    recipe = [a for a in argv if a.startswith("recipe=")] or ["recipe=recipes/vlm.yaml"]
    user = [a for a in argv if not a.startswith("recipe=")]
    results = {}
    with tempfile.TemporaryDirectory() as out:
        common = [
            *recipe,
            "train.max_steps=2",
            "schedule.warmup_steps=0",
            "log.wandb_mode=disabled",
            "train.save_steps=0",
            f"train.output_dir={out}",
            *user,
        ]
        for name, freeze in (("frozen", f"[{TOWER}]"), ("training", "[]")):
            env = {**os.environ, "WANDB_MODE": "disabled"}
            proc = subprocess.run(
                [sys.executable, __file__, "--variant", *common, f"model.freeze={freeze}"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env=env,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode or 1
            results[name] = json.loads(line[len("RESULT ") :])
    frozen, training = results["frozen"], results["training"]
    print(f"VLM training-step memory, {' '.join(recipe + user) or 'recipes/vlm.yaml'}; {frozen['device']}")
    print(
        f"{'tower':<10}{'trainable':>14}{'peak MB':>12}{'step growth MB':>16}{'activations MB':>16}"
        f"{'in tower MB':>13}{'tower grads MB':>16}"
    )
    for name, r in results.items():
        print(
            f"{name:<10}{r['trainable_params']:>14,}{r['peak_mb']:>12.1f}{r['peak_mb'] - r['before_mb']:>16.1f}"
            f"{r['activations_mb']:>16.1f}{r['tower_activations_mb']:>13.2f}{r['tower_grads_mb']:>16.2f}"
        )
    print(
        f"ratio frozen/training: peak {frozen['peak_mb'] / training['peak_mb']:.3f}, step growth "
        f"{(frozen['peak_mb'] - frozen['before_mb']) / max(training['peak_mb'] - training['before_mb'], 1e-9):.3f}, "
        f"activations {frozen['activations_mb'] / max(training['activations_mb'], 1e-9):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
