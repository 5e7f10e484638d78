"""Step time of LAMB and LARS against torch AdamW (foreach) on a ~100M-parameter transformer-shaped model, on CPU.

    OMP_NUM_THREADS=1 python scripts/bench_optimizers.py [--layers 11] [--rounds 15] [--steps 1] [--threads 1]

Only `optimizer.step()` is timed (gradients are fixed random tensors, shared by all three), with the recipe's
parameter groups (biases, norms and the embedding: no decay, no trust ratio). The optimizers are timed interleaved,
round by round, so a noisy shared machine slows them alike; each round gives a ratio to AdamW and the report is the
median over rounds, of wall-clock time and of this process's CPU time (the steadier of the two when other processes
compete for the cores). One thread by default: on a shared, oversubscribed machine two threads per process made
every step 5–10× slower and the ratios swing from 0.3 to 3.6; raise --threads on a dedicated machine.
Target: LAMB and LARS ≤ 1.5× AdamW.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from finetune.recipe import OptimConfig
from finetune.training.optim import build_optimizer

NAMES = ("adamw", "lamb", "lars")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)


class Model(nn.Module):
    """GPT-2-small-shaped: a 32k×768 embedding and `layers` blocks (11 → 102.6M parameters)."""

    def __init__(self, layers: int, width: int = 768, vocab: int = 32000):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)


def seconds_per_step(optimizer: torch.optim.Optimizer, steps: int) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds per step."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per optimizer per round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    base = Model(args.layers)
    grads = [torch.randn_like(p) * 1e-3 for p in base.parameters()]
    optimizers = {}
    for name in NAMES:
        model = copy.deepcopy(base)
        for p, g in zip(model.parameters(), grads):
            p.grad = g  # the same gradient tensors for all three: only the update differs
        cfg = OptimConfig(name=name, weight_decay=0.01, trust_coefficient=0.001)
        optimizers[name] = build_optimizer(model, cfg, 1e-3)
        seconds_per_step(optimizers[name], 2)  # state allocation and first-touch page faults, untimed
    del base
    n_params = sum(p.numel() for p in grads)
    adamw = optimizers["adamw"]
    print(
        f"{n_params / 1e6:.1f}M parameters, fp32, CPU, {torch.get_num_threads()} threads; AdamW foreach="
        f"{adamw.defaults['foreach']}; {args.rounds} rounds × {args.steps} steps per optimizer, interleaved"
    )

    times = {name: [] for name in NAMES}
    for round_index in range(args.rounds):
        order = NAMES if round_index % 2 == 0 else NAMES[::-1]  # no optimizer always runs first
        for name in order:
            times[name].append(seconds_per_step(optimizers[name], args.steps))
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{n} {times[n][-1][0] * 1e3:.0f} ms (cpu {times[n][-1][1] * 1e3:.0f})" for n in NAMES),
            flush=True,
        )

    for kind, index in (("wall", 0), ("cpu", 1)):
        medians = ", ".join(f"{n} {statistics.median(t[index] for t in times[n]) * 1e3:.0f} ms" for n in NAMES)
        print(f"median {kind} time per step: {medians}")
        for name in ("lamb", "lars"):
            ratios = [t[index] / a[index] for t, a in zip(times[name], times["adamw"])]
            verdict = "meets" if statistics.median(ratios) <= 1.5 else "misses"
            best = min(t[index] for t in times[name]) / min(t[index] for t in times["adamw"])
            print(
                f"  {name} / adamw ({kind}): median ratio {statistics.median(ratios):.2f} (per round: "
                f"{', '.join(f'{r:.2f}' for r in ratios)}); {verdict} the 1.5× target; fastest/fastest {best:.2f}"
            )


if __name__ == "__main__":
    main()
