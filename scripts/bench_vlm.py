"""Throughput and peak memory of the VLM seed recipe's training, padded vs token_budget vs packed, in one run.

    python scripts/bench_vlm.py --quick --json bench_vlm.json
    python scripts/bench_vlm.py --recipe recipes/vlm_qwen.yaml --steps 8   # any VLM recipe; key=value overrides pass on

Each mode trains in its own fresh process (same rows, same seed, same model) through `finetune.assemble.build` with
8 rows per micro-batch (token_budget: 8 median-length rows' worth of padded tokens), 2 micro-batches per optimizer
step (`--micro-batch`, `--accumulation`); the first optimizer step is a warm-up, the later ones are timed. Per mode:
- real_tokens_per_s: tokens of the rows themselves (no padding) through forward and backward per second;
- samples_per_s: rows (image + caption) per second;
- peak_mem_mb: the process's peak memory over the timed steps (CUDA: max_memory_allocated; CPU: VmHWM, reset first).
The modes run on CPU (CUDA hidden), and again on CUDA where one is present (under the "cuda" key of the JSON);
`--device cuda` runs the CUDA ones only (`--device cpu` the CPU ones).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO, ACCUMULATION = 8, 2
MODES = {
    "padded": ["data.batching=padded"],
    "token_budget": ["data.batching=token_budget"],  # + the budget, from the rows' median length (budget_overrides)
    "packed": ["data.batching=packed"],
}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class Throughput:
    """Counts the rows and real tokens of every training forward from the second optimizer step on (a forward
    pre-hook on the model: only what is really trained is counted, never a prefetched batch)."""

    def __init__(self):
        self.rows = self.tokens = 0
        self.start: float | None = None
        self.timing = False

    def hook(self, module, args, kwargs):
        if not (self.timing and module.training):
            return
        if self.start is None:
            self.start = time.perf_counter()
        from finetune.core.meter import batch_counts  # the trainer's own count: packed rows, [4, B, L] positions

        _, real, _, sequences = batch_counts(kwargs)
        self.rows += sequences
        self.tokens += real


def reset_peak(cuda: bool) -> None:
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS


def peak_mb(cuda: bool) -> float:
    import torch

    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return _rss_kb("VmHWM") / 1024


def measure(overrides: list[str]) -> dict:
    """One mode, in this process: train, time every optimizer step after the first."""
    import torch
    from transformers import TrainerCallback

    from finetune.assemble import build
    from finetune.recipe import load_config

    cuda = torch.cuda.is_available()
    trainer = build(load_config(overrides), evaluate=False)
    meter = Throughput()
    trainer.model.register_forward_pre_hook(meter.hook, with_kwargs=True)

    class TimeAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                reset_peak(cuda)
                meter.timing = True

    trainer.add_callback(TimeAfterFirstStep())
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - meter.start
    return {
        "real_tokens_per_s": meter.tokens / seconds,
        "samples_per_s": meter.rows / seconds,
        "peak_mem_mb": peak_mb(cuda),
        "rows": meter.rows,
        "real_tokens": meter.tokens,
        "seconds": seconds,
        "device": torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads",
    }


def budget_overrides(common: list[str], micro: int, accumulation: int) -> list[str]:
    """token_budget: as many padded tokens per micro-batch as `micro` rows of the median length (at least one row of
    data.max_length)."""
    from finetune.data.vision import load_vision_dataset
    from finetune.model import loading, vlm
    from finetune.recipe import load_config

    cfg = load_config(common)
    processor = vlm.load_processor(cfg.model, loading.model_folder(cfg.model))
    rows, _ = load_vision_dataset(cfg.data, processor)
    lengths = sorted(rows["length"])
    budget = max(micro * lengths[len(lengths) // 2], cfg.data.max_length)  # a longest row must fit
    return [f"data.max_tokens_per_micro_batch={budget}", f"train.global_batch_tokens={budget * accumulation}"]


def run_modes(common: list[str], env: dict, micro: int, accumulation: int) -> dict:
    results = {}
    for mode, extra in MODES.items():
        extra = extra + (budget_overrides(common, micro, accumulation) if mode == "token_budget" else [])
        proc = subprocess.run(
            [sys.executable, __file__, "--variant", *common, *extra], cwd=ROOT, capture_output=True, text=True, env=env
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(proc.returncode or 1)
        results[mode] = json.loads(line[len("RESULT ") :])
    return results


def table(results: dict) -> str:
    lines = [f"{'mode':<14}{'real tokens/s':>15}{'samples/s':>11}{'peak MB':>10}{'vs padded':>11}"]
    for mode, r in results.items():
        ratio = r["samples_per_s"] / results["padded"]["samples_per_s"]
        lines.append(
            f"{mode:<14}{r['real_tokens_per_s']:>15.1f}{r['samples_per_s']:>11.2f}{r['peak_mem_mb']:>10.0f}"
            f"{ratio:>10.2f}×"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--variant":
        print("RESULT " + json.dumps(measure(argv[1:])), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 optimizer steps per mode (2 timed)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per mode, the first untimed")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--recipe", help="the VLM recipe to measure (default recipes/vlm_seed.yaml; recipe=PATH too)")
    parser.add_argument("--micro-batch", type=int, default=MICRO, help=f"rows per micro-batch (default {MICRO})")
    parser.add_argument("--accumulation", type=int, default=ACCUMULATION, help=f"default {ACCUMULATION}")
    parser.add_argument(
        "--device", choices=("cpu", "cuda", "both"), default="both", help="both (default): the CPU, and CUDA if present"
    )
    args, overrides = parser.parse_known_args(argv)
    steps = 3 if args.quick else args.steps
    recipe = [f"recipe={args.recipe}"] if args.recipe else [a for a in overrides if a.startswith("recipe=")]
    recipe = recipe or ["recipe=recipes/vlm_seed.yaml"]
    micro, accumulation = args.micro_batch, args.accumulation
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    with tempfile.TemporaryDirectory() as out:
        common = [
            *recipe,
            f"data.limit={micro * accumulation * (steps + 2)}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro * accumulation}",
            f"train.max_steps={steps}",
            "log.wandb_mode=disabled",
            "train.save_steps=0",
            f"train.output_dir={out}",
            *[a for a in overrides if not a.startswith("recipe=")],
        ]
        env, results = {**os.environ, "WANDB_MODE": "disabled"}, {}
        if args.device != "cuda":  # the CPU's figures at the top level, CUDA's under "cuda"
            results = run_modes(common, {**env, "CUDA_VISIBLE_DEVICES": ""}, micro, accumulation)
            print(f"VLM training throughput, {' '.join(recipe)}; {results['padded']['device']}\n{table(results)}")
        if args.device != "cpu" and torch.cuda.is_available():
            results["cuda"] = run_modes(common, env, micro, accumulation)
            print(f"\n{results['cuda']['padded']['device']}\n{table(results['cuda'])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
