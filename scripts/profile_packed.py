"""One profiled packed optimizer step of a recipe (`train.profile_steps`), summarised by scripts/profile_summary.py:
the top kernels, the idle gaps between them and the host syncs per step. scripts/gpu_steps.py's `profile_packed`
runs it on the ~0.5B model of scripts/benchmark.py (recipes/bench.yaml at hidden 1,280, 24 layers) in bf16 at
micro-batch 32 × accumulation 4; `--smoke` on recipes/debug.yaml.

    python scripts/profile_packed.py --work /tmp/profile --json profile.json --markdown profile.md \
        recipe=recipes/bench.yaml train.precision=bf16 ...

Steps 1 and 2 train; step 2 is profiled (step 1 carries the allocator's and kernels' warm-up). Nothing is saved.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from profile_summary import summarize, write  # beside this script

PROFILED = 2  # the optimizer step under the profiler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="the run's output folder (the trace and table land here)")
    parser.add_argument("--json", required=True, help="the summary as JSON")
    parser.add_argument("--markdown", help="the summary as markdown")
    args, overrides = parser.parse_known_args(argv)

    import finetune
    from finetune.recipe import accumulation_steps

    keys = ["log.wandb_mode=disabled", "train.save_steps=0", f"train.max_steps={PROFILED}"]
    keys += [f"train.profile_steps=[{PROFILED},{PROFILED}]", f"train.output_dir={args.work}"]
    cfg = finetune.load_config([*overrides, *keys])
    finetune.build(cfg, evaluate=False).train()
    trace = Path(args.work) / f"profile_steps_{PROFILED}-{PROFILED}.trace.json"
    summary = summarize(json.loads(trace.read_text()), 1, accumulation_steps(cfg, 1))
    summary["recipe"] = [*overrides, *keys]
    write(summary, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
