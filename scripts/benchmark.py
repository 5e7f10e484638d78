"""Training throughput and memory of HF Trainer, a hand-written loop and our batching modes, side by side, one process.

    OMP_NUM_THREADS=2 python scripts/benchmark.py --quick [--json bench.json]
    OMP_NUM_THREADS=2 python scripts/benchmark.py --steps 3 --rounds 2 --json bench.json
    python scripts/benchmark.py --model smollm2 --quick

The built-in docstring set with the SmolLM2 tokenizer and chat template (loss on the assistant's tokens), the model of
recipes/bench.yaml (Llama-shaped, hidden 384, 6 layers, SmolLM2 vocabulary, random init with the same seed for every
arm; `--model smollm2`: the real SmolLM2-135M), micro-batch 8 × accumulation 4, fp32. Arms:

- hf_padded:  transformers.Trainer (TrainingArguments defaults otherwise: fused AdamW, linear schedule),
  DataCollatorForSeq2Seq (labels -100 on padding), random order;
- hf_flatten: transformers.Trainer, DataCollatorWithFlattening (padding-free rows of 8 sequences);
- padded, length_grouped, token_budget, packed: ours, `finetune.assemble.build(cfg)` on recipes/bench.yaml with
  data.batching set (what users run). token_budget holds the mean computed tokens of a random padded micro-batch of 8
  (`data.max_tokens_per_micro_batch`) and 4× that per optimizer step (`train.global_batch_tokens`); packed puts 8
  sequences in a row, as hf_flatten does (`--packed budget`: filled to the token budget instead);
- hand_loop:  plain PyTorch over exactly the micro-batches hf_padded trained on: full logits, cross-entropy against the
  shifted labels summed and divided by the window's label tokens, backward, clip, AdamW (foreach on CPU, fused on
  CUDA, as ours).

Each arm builds its model (same seed) and trainer, runs `--warmup` optimizer steps untimed, then `--steps` timed; rounds
repeat all arms in a rotated order and report the median rate. Tokens are counted at the model's forward: computed =
input_ids elements, real = attention-mask ones (every position of a padding-free row). Peak memory above the arm's
start (weights, gradients and optimizer states included): on CUDA max_memory_allocated; on CPU the resident-set
high-water mark (VmHWM, reset through /proc/self/clear_refs) after gc and malloc_trim. The packed arm runs once more
with accumulation 1 over the same micro-batches, for the accumulation memory target.

On a shared machine wall-clock rates mean little: "others CPU" is the share of the machine's CPU time other processes
used during an arm's timed steps, and an arm is re-run (`--retries`) while they took cores its threads needed. CPU time
("real tok/CPU-s") is no cure: threads that wait for a busy core spin and inflate it. The targets use wall-clock.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "bench.yaml"
ARMS = ("hf_padded", "hf_flatten", "padded", "length_grouped", "token_budget", "packed", "hand_loop")
OURS = ("padded", "length_grouped", "token_budget", "packed")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


# ---- measuring ----


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
    """Forward pre-hook counting computed and real tokens (and keeping the batches if asked); `mark()` at the end of
    every optimizer step records wall time, CPU time and the counts."""

    def __init__(self, cuda: bool, keep_batches: bool = False):
        self.cuda, self.computed, self.real = cuda, 0, 0
        self.batches: list[dict] | None = [] if keep_batches else None
        self.marks = [(time.perf_counter(), time.process_time(), machine_busy(), 0, 0)]

    def __call__(self, module, args, kwargs):
        if not torch.is_grad_enabled():  # a gradient-free forward (our chunked-head probe) trains on nothing
            return
        from finetune.meter import batch_counts  # what the trainer logs: real = attention-mask ones, or all if none

        _, real, computed, _ = batch_counts(kwargs)
        self.real, self.computed = self.real + real, self.computed + computed
        if self.batches is not None:
            keys = ("input_ids", "attention_mask", "labels")
            self.batches.append({k: kwargs[k].detach().cpu().clone() for k in keys})

    def mark(self, *_, **__) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks.append((time.perf_counter(), time.process_time(), machine_busy(), self.real, self.computed))

    def result(self, warmup: int) -> dict:
        (t0, p0, b0, r0, c0), (t1, p1, b1, r1, c1) = self.marks[warmup], self.marks[-1]
        cores = os.cpu_count() or 1
        others = max(0.0, (b1 - b0) - (p1 - p0)) / max((t1 - t0) * cores, 1e-9)  # of the machine's CPU time
        return {"seconds": t1 - t0, "cpu_seconds": p1 - p0, "real_tokens": r1 - r0, "computed_tokens": c1 - c0,
                "steps": len(self.marks) - 1 - warmup, "all_real": r1, "all_computed": c1, "others_cpu": others}

    def attach(self, trainer) -> None:
        from transformers import PrinterCallback, ProgressCallback, TrainerCallback

        for quiet in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(quiet)
        trainer.add_callback(type("StepClock", (TrainerCallback,), {"on_step_end": self.mark})())
        trainer.model.register_forward_pre_hook(self, with_kwargs=True)


# ---- the arms ----


class Bench:
    """What every arm shares: the options, the recipe, the data, the token budget."""

    def __init__(self, args):
        from finetune.data.text import load_sft_dataset
        from finetune.model.loading import load_tokenizer, model_folder

        self.args, self.scratch = args, tempfile.mkdtemp(prefix="bench-")
        self.cfg = self.config([])
        self.micro, self.accumulation = args.micro_batch, args.accumulation
        self.tokenizer = load_tokenizer(self.cfg.model, model_folder(self.cfg.model))
        self.dataset, self.report = load_sft_dataset(self.cfg.data, self.tokenizer)
        lengths = [len(ids) for ids in self.dataset["input_ids"]]
        self.budget = max(round(mean_padded_tokens(lengths, self.micro)), self.cfg.data.max_length)
        self.steps = args.warmup + args.steps
        self.hand_batches: list[dict] | None = None  # recorded by hf_padded

    def config(self, overrides: list[str]):
        """recipes/bench.yaml with the data options, `overrides` and the model of --model."""
        from finetune.recipe import load_config

        a = self.args
        keys = [f"train.micro_batch_size={a.micro_batch}", f"train.global_batch_size={a.micro_batch * a.accumulation}"]
        keys += [f"data.limit={a.limit}"] if a.limit else []
        keys += [f"data.max_length={a.max_length}"] if a.max_length else []
        keys += [*overrides, f"train.output_dir={tempfile.mkdtemp(dir=self.scratch)}"]
        cfg = load_config([f"recipe={RECIPE}", *keys])
        if a.model == "smollm2":  # the pretrained weights, not a random init
            cfg.model.from_config, cfg.model.config_overrides = False, {}
        elif a.model == "tiny":
            cfg.model.config_overrides = dict(TINY)
        return cfg

    def describe(self) -> str:
        o = self.cfg.model.config_overrides
        model = ("SmolLM2-135M-Instruct (pretrained)" if self.args.model == "smollm2" else
                 f"Llama, hidden {o['hidden_size']}, {o['num_hidden_layers']} layers, SmolLM2 vocabulary, random init")
        device = f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else \
            f"CPU, {torch.get_num_threads()} thread(s)"
        return (f"data: {self.report.summary()}\nmodel: {model}; fp32; {device}\nbatch: micro {self.micro} × "
                f"accumulation {self.accumulation}; token budget {self.budget} computed tokens per micro-batch (the "
                f"mean of a random padded one), {self.budget * self.accumulation} per step; packed: {self.args.packed}"
                f"\n{self.args.warmup} warm-up + {self.args.steps} timed optimizer steps per arm, {self.args.rounds} "
                f"round(s)")

    def run(self, arm: str, accumulation: int | None = None, steps: int | None = None) -> Clock:
        cuda = torch.cuda.is_available()
        if arm in OURS:
            return self.run_ours(arm, accumulation or self.accumulation, steps or self.steps, cuda)
        if arm == "hand_loop":
            return self.run_hand_loop(cuda)
        return self.run_hf(arm, cuda)

    def run_ours(self, arm: str, accumulation: int, steps: int, cuda: bool) -> Clock:
        from finetune.assemble import build

        keys = [f"train.max_steps={steps}", "log.wandb_mode=disabled", "train.save_steps=0"]
        if arm == "token_budget" or (arm == "packed" and self.args.packed == "budget"):
            keys += [f"data.max_tokens_per_micro_batch={self.budget}",
                     f"train.global_batch_tokens={self.budget * accumulation}"]
        else:
            keys += [f"train.global_batch_size={self.micro * accumulation}"]
        cfg = self.config([*keys, f"data.batching={arm}"])
        with contextlib.redirect_stdout(io.StringIO()):  # build's start-up lines
            trainer = build(cfg)
        clock = Clock(cuda)
        clock.attach(trainer)
        trainer.train()
        # what accumulating must keep between micro-batches: one gradient per trainable parameter
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        self.gradient_mb = sum(p.numel() * p.element_size() for p in trainable) / 2**20
        return clock

    def new_model(self):
        from transformers import set_seed

        from finetune.model.loading import load_model, model_folder

        set_seed(self.cfg.train.seed)  # as build() does: the same initial weights in every arm
        return load_model(self.cfg.model, model_folder(self.cfg.model))

    def run_hf(self, arm: str, cuda: bool) -> Clock:
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainingArguments

        collator = (DataCollatorWithFlattening() if arm == "hf_flatten"
                    else DataCollatorForSeq2Seq(self.tokenizer, label_pad_token_id=-100, return_tensors="pt"))
        t = self.cfg.train
        args = TrainingArguments(
            output_dir=t.output_dir, per_device_train_batch_size=self.micro,
            gradient_accumulation_steps=self.accumulation, max_steps=self.steps, learning_rate=self.cfg.optim.lr,
            max_grad_norm=t.max_grad_norm, seed=t.seed,
            report_to=[], save_strategy="no", logging_steps=10**6, use_cpu=not cuda,
        )
        trainer = Trainer(model=self.new_model(), args=args, train_dataset=self.dataset, data_collator=collator)
        clock = Clock(cuda, keep_batches=arm == "hf_padded" and self.hand_batches is None)
        clock.attach(trainer)
        trainer.train()
        self.hand_batches = self.hand_batches or clock.batches
        return clock

    def run_hand_loop(self, cuda: bool) -> Clock:
        import torch.nn.functional as F

        device = torch.device("cuda" if cuda else "cpu")
        model, o = self.new_model().to(device).train(), self.cfg.optim
        optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                      weight_decay=o.weight_decay, **({"fused": True} if cuda else {"foreach": True}))
        clock, k = Clock(cuda), self.accumulation
        for step in range(self.steps):
            window = self.hand_batches[step * k : (step + 1) * k]
            label_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
            for batch in window:
                ids, mask, labels = (batch[key].to(device) for key in ("input_ids", "attention_mask", "labels"))
                clock(model, (), {"input_ids": ids, "attention_mask": mask})
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                # shift the labels, not the logits: slicing [B, T, V] logits would copy them
                targets = F.pad(labels[:, 1:], (0, 1), value=-100)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
                (loss / label_tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.train.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.mark()
        return clock


def mean_padded_tokens(lengths: list[int], micro: int) -> float:
    """Expected micro × longest of `micro` rows drawn at random without replacement (exact, by order statistics)."""
    ordered, total = sorted(lengths), math.comb(len(lengths), micro)
    return micro * sum(length * math.comb(k, micro - 1) for k, length in enumerate(ordered)) / total


# ---- report ----


def summarize(runs: list[dict]) -> dict:
    def median_rate(tokens, seconds):
        return statistics.median(r[tokens] / r[seconds] for r in runs)

    return {
        "real_tokens_per_s": median_rate("real_tokens", "seconds"),
        "computed_tokens_per_s": median_rate("computed_tokens", "seconds"),
        "real_tokens_per_cpu_s": median_rate("real_tokens", "cpu_seconds"),
        "real_token_share": sum(r["all_real"] for r in runs) / sum(r["all_computed"] for r in runs),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in runs),
        "others_cpu_share": statistics.mean(r["others_cpu"] for r in runs),
        "timed_steps": sum(r["steps"] for r in runs),
        "attempts": sum(r["attempts"] for r in runs),
        "timed_real_tokens": sum(r["real_tokens"] for r in runs),
        "timed_computed_tokens": sum(r["computed_tokens"] for r in runs),
    }


def targets(results: dict, accumulation: int = 4) -> list[tuple[str, bool | None, str]]:
    """(target, passed, measured); passed is None where an arm it needs did not run."""
    def get(arm, key):
        return results.get(arm, {}).get(key)

    def at_least(name, a, b, factor):  # a ≥ factor × b
        return (name, None, "n/a") if None in (a, b) else (name, a >= factor * b, f"{a / b:.2f}×")

    def at_most(name, a, b, factor):
        return (name, None, "n/a") if None in (a, b) else (name, a <= factor * b, f"{a / b:.2f}×")

    rows = []
    for arm in ("packed", "token_budget"):
        rows.append(at_least(f"{arm} ≥ 1.2× hf_flatten real tokens/s", get(arm, "real_tokens_per_s"),
                             get("hf_flatten", "real_tokens_per_s"), 1.2))
        share = get(arm, "real_token_share")
        rows.append((f"{arm} real-token share ≥ 0.95", None if share is None else share >= 0.95,
                     "n/a" if share is None else f"{share:.3f}"))
    rows.append(at_least("padded ≥ 0.97× hand_loop real tokens/s", get("padded", "real_tokens_per_s"),
                         get("hand_loop", "real_tokens_per_s"), 0.97))
    rows.append(at_most("packed peak memory ≤ 0.8× hf_flatten", get("packed", "peak_mem_mb"),
                        get("hf_flatten", "peak_mem_mb"), 0.8))
    rows.append(at_most(f"packed peak memory, accumulation {accumulation} ≤ 1.1× accumulation 1",
                        get("packed", "peak_mem_mb"), get("packed", "peak_mem_mb_accumulation_1"), 1.1))
    return rows


def print_report(results: dict, memory_kind: str, header: str, accumulation: int) -> None:
    print(f"\n{header}\npeak MiB: {memory_kind}, above the arm's start; others CPU: the share of the machine's CPU "
          "time other processes used during the timed steps (high: wall-clock rates are not comparable)\n")
    print(f"{'arm':<24}{'real tok/s':>11}{'computed tok/s':>15}{'real share':>11}{'peak MiB':>9}"
          f"{'real tok/CPU-s':>15}{'others CPU':>11}{'timed steps':>12}")
    for arm, r in results.items():
        print(f"{arm:<24}{r['real_tokens_per_s']:>11.0f}{r['computed_tokens_per_s']:>15.0f}"
              f"{r['real_token_share']:>11.3f}{r['peak_mem_mb']:>9.0f}{r['real_tokens_per_cpu_s']:>15.0f}"
              f"{r['others_cpu_share']:>11.0%}{r['timed_steps']:>12}")
    if "peak_mem_mb_accumulation_1" in results.get("packed", {}):
        packed = results["packed"]
        print(f"{'packed, accumulation 1':<24}{'':>37}{packed['peak_mem_mb_accumulation_1']:>9.0f}   (accumulating "
              f"keeps the gradients between micro-batches: {packed['gradient_mb']:.0f} MiB)")
    print("\ntargets:")
    for name, passed, measured in targets(results, accumulation):
        print(f"  {'n/a ' if passed is None else 'PASS' if passed else 'FAIL'}  {name}: {measured}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 1 timed step per arm, 1 round, no re-runs")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per arm per round (default 3; --quick 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first (default 1)")
    parser.add_argument("--rounds", type=int, help="repeats of all arms, rotated order (default 2; --quick 1)")
    parser.add_argument("--model", choices=("bench", "smollm2", "tiny"), default="bench",
                        help="bench: recipes/bench.yaml (hidden 384, 6 layers); smollm2: SmolLM2-135M; tiny: tests")
    parser.add_argument("--packed", choices=("sequences", "budget"), default="sequences",
                        help="packed rows of --micro-batch sequences (as hf_flatten), or filled to the token budget")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--limit", type=int, help="data.limit: the first N rows only (tests)")
    parser.add_argument("--max-length", type=int, help="data.max_length (recipe: 1024; tests use less)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-others", type=float, default=0.1,
                        help="re-run an arm when other processes used more than this share of the machine's CPU "
                             "beyond the cores --threads leaves free, during its timed steps (default 0.1)")
    parser.add_argument("--retries", type=int, help="re-runs per arm at most (default 2; --quick 0, to stay quick)")
    parser.add_argument("--json", help="write {arm: {real_tokens_per_s, real_token_share, peak_mem_mb, …}} here")
    args = parser.parse_args(argv)
    args.steps, args.rounds = args.steps or (1 if args.quick else 3), args.rounds or (1 if args.quick else 2)
    args.retries = args.retries if args.retries is not None else (0 if args.quick else 2)
    asked = args.arms.split(",")
    if set(asked) - set(ARMS):
        parser.error(f"unknown arm(s) {', '.join(sorted(set(asked) - set(ARMS)))}; choose from {', '.join(ARMS)}")
    if "hand_loop" in asked and "hf_padded" not in asked:
        parser.error("hand_loop replays hf_padded's micro-batches: include hf_padded")
    args.arms = [a for a in ARMS if a in asked]
    return args


def run_arm(bench: Bench, memory: PeakMemory, arm: str, label: str, started: float) -> dict:
    """One run of the arm, repeated (up to --retries times) while other processes took more than --max-others of the
    machine's CPU beyond the cores our threads leave free, during its timed steps; the least disturbed run counts."""
    attempts = []
    for _ in range(1 + bench.args.retries):
        memory.start()
        result = {**bench.run(arm).result(bench.args.warmup), "peak_mem_mb": memory.peak_mb()}
        attempts.append(result)
        r, elapsed = result, time.perf_counter() - started
        print(f"  {label} {arm}: {r['real_tokens'] / r['seconds']:.0f} real tokens/s, {r['seconds']:.1f} s timed "
              f"({r['cpu_seconds']:.1f} s CPU, others {r['others_cpu']:.0%}), peak {r['peak_mem_mb']:.0f} MiB "
              f"[{elapsed:.0f} s]", flush=True)
        # disturbed: other processes took cores our threads needed
        spare = max(0.0, 1 - bench.args.threads / (os.cpu_count() or 1))
        if result["others_cpu"] <= spare + bench.args.max_others:
            break
    return {**min(attempts, key=lambda r: r["others_cpu"]), "attempts": len(attempts)}


def measure(bench: Bench, started: float) -> tuple[dict, str]:
    """Every arm, round by round (rotated order), then the packed micro-batches alone: {arm: summary}, memory kind."""
    args, memory = bench.args, PeakMemory(torch.cuda.is_available())
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    accumulation_1 = None
    for round_index in range(args.rounds):
        shift = round_index % len(args.arms)
        order = args.arms[shift:] + args.arms[:shift]
        if bench.hand_batches is None and "hand_loop" in order:  # hf_padded records what hand_loop replays
            order.remove("hf_padded")
            order.insert(order.index("hand_loop"), "hf_padded")
        for arm in order:
            runs[arm].append(run_arm(bench, memory, arm, f"round {round_index + 1}", started))
        if "packed" in args.arms and accumulation_1 is None:
            # The packed micro-batches alone (accumulation 1): the same ones, since the Trainer's sampler order does
            # not depend on the accumulation.
            memory.start()
            bench.run("packed", accumulation=1, steps=bench.steps * bench.accumulation)
            accumulation_1 = memory.peak_mb()
    results = {arm: summarize(r) for arm, r in runs.items()}
    if accumulation_1 is not None:
        results["packed"]["peak_mem_mb_accumulation_1"] = accumulation_1
        results["packed"]["gradient_mb"] = bench.gradient_mb
    return results, memory.kind


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars of --model smollm2
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    bench = Bench(args)
    try:
        print(bench.describe(), flush=True)
        results, memory_kind = measure(bench, started)
    finally:
        shutil.rmtree(bench.scratch, ignore_errors=True)
    print_report(results, memory_kind, bench.describe(), bench.accumulation)
    print(f"\ntotal {time.perf_counter() - started:.0f} s wall, {time.process_time():.0f} s CPU")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
