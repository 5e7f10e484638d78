"""A fresh process, as `finetune-plan` runs: the plan for a recipe (recipes/debug.yaml unless given as arguments:
`recipe=… key=value …`) at global batch 32 given just less memory than a step at micro-batch 32 takes; prints one JSON
line of what tests/test_plan.py checks.

In a long test process freed heap stays resident, so the RSS before a trial step (which the CPU plan counts) carries
other tests' leftovers; a process of its own measures what a user's plan would."""

import json
import sys

from finetune.recipe import load_config
from finetune.tools import memory_trials
from finetune.tools import plan as planner

GIB = 2**30


def rss_high_water_mark() -> float:
    with open("/proc/self/status") as f:
        return float(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def step_high_water_mark(trials, value) -> float:
    """Peak RSS of one worst-case training step at `value`, as the operating system counts it."""
    memory_trials.trimmed_rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the RSS high-water mark (Linux)
    trials.peak(value)
    return rss_high_water_mark()


def main() -> None:
    recipe = sys.argv[1:] or ["recipe=recipes/debug.yaml"]
    cfg = load_config([*recipe, "train.global_batch_size=32"])
    trials = memory_trials.Trials(cfg, 1)
    memory = step_high_water_mark(trials, 32) - 2**20
    result = planner.plan(cfg, 1, headroom=0.1, memory_gib=memory / GIB, trials=trials)
    figures = {
        "memory": memory,
        "value": result.value,
        "accumulation": result.accumulation,
        "global_batch": result.global_batch,
        "peak_bytes": result.peak_bytes,
        "limit_bytes": result.limit_bytes,
        "lr": result.lr,
        "config_lr": cfg.optim.lr,
        "describe": result.describe(),
        "chosen_step_high_water_mark": step_high_water_mark(trials, result.value),
    }
    print("PLAN " + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
