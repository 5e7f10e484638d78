"""The largest micro-batch that fits, with the global batch kept: `python -m finetune.plan recipe=… [key=value …]`.

    python -m finetune.plan recipe=recipes/quickstart.yaml [plan.headroom=0.1] [plan.memory_gib=24] [plan.ranks=8]

Candidates are the micro-batches that divide the global batch per rank (`train.global_batch_size / ranks`, or the
token budgets ≥ data.max_length dividing `train.global_batch_tokens / ranks` for token-budgeted batching), so the
accumulation `global / (micro × ranks)` is a whole number and the global batch, hence the LR, does not change.
A trial is one real training step of the recipe's trainer (forward, backward, optimizer step; precision, LoRA,
freeze, checkpointing as recipe'd) on the worst case: copies of the dataset's longest row, every token a target.

- GPU: binary search over the candidates by trials; a trial fits when it does not run out of memory and its peak
  reserved memory is within the limit.
- CPU: an out-of-memory there kills the process, so trials run only where they are clearly safe and small; each gives
  the RSS before the step plus the peak of tensor bytes the step allocated (torch's profiler: exact, where the RSS
  high-water mark also counts what the C allocator keeps), and a least-squares line in tokens predicts the rest.

The limit is (1 − plan.headroom) × (plan.memory_gib, or the GPU's memory, or this process's RSS + the RAM available),
shared by the ranks of one machine on CPU. Under several ranks the trials run without DDP, which then adds one copy
of the trainable gradients (its buckets); that copy is added to every figure. `train.micro_batch_size: auto` runs
this planner when training starts.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field

from finetune.config import Config, RecipeError, is_budgeted, load_config

HEADROOM = 0.10
GIB = 2**30
CPU_TRIAL_TOKENS = 8192  # CPU trials stay this small (a step of a real model at 8k tokens takes a minute or more)
SAFE_TRIAL = 0.8  # a CPU trial runs only where the prediction so far is this far below the limit


@dataclass
class Plan:
    key: str  # the recipe key the plan sets
    value: int  # sequences per micro-batch, or tokens per micro-batch when budgeted
    accumulation: int
    ranks: int
    global_batch: int
    unit: str  # sequences | tokens
    peak_bytes: float  # expected peak memory per rank at `value`
    limit_bytes: float
    limit_text: str
    lr: float
    lr_text: str
    how: str  # what was measured
    measured: dict[int, float] = field(default_factory=dict)  # candidate → measured peak bytes
    predicted: dict[int, float] = field(default_factory=dict)  # candidate → expected peak bytes

    def describe(self) -> str:
        per = f"{self.value} {self.unit}" if self.unit == "tokens" else f"{self.value}"
        return "\n".join([
            f"plan: {self.how}",
            f"  limit {self.limit_bytes / GIB:.2f} GiB ({self.limit_text})",
            f"  micro-batch {per}, accumulation {self.accumulation}, {self.ranks} rank{'s' if self.ranks != 1 else ''}"
            f" → global batch {self.global_batch} {self.unit} (kept)",
            f"  expected peak memory {self.peak_bytes / GIB:.2f} GiB per rank",
            f"  lr {self.lr_text}",
            f"  set: {self.key}={self.value}",
        ])


def split_args(argv: list[str]) -> tuple[list[str], dict]:
    """(recipe arguments, plan options): plan.* keys are this tool's, not the recipe's."""
    rest, options = [], {"headroom": HEADROOM, "memory_gib": None, "ranks": None}
    for arg in argv:
        key, _, value = arg.partition("=")
        if not key.strip().startswith("plan."):
            rest.append(arg)
            continue
        name = key.strip().removeprefix("plan.")
        if name not in options:
            raise RecipeError(f"unknown key '{key}'; plan takes plan.headroom, plan.memory_gib and plan.ranks")
        try:
            options[name] = int(value) if name == "ranks" else float(value)
        except ValueError:
            raise RecipeError(f"{key}={value!r} is not a number") from None
    if not 0 <= options["headroom"] < 1 or (options["ranks"] or 1) < 1 or (options["memory_gib"] or 1) <= 0:
        raise RecipeError("plan.headroom must be in [0, 1), plan.ranks ≥ 1 and plan.memory_gib positive")
    return rest, options


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidates(cfg: Config, ranks: int) -> tuple[str, str, int, list[int]]:
    """(recipe key, unit, global batch, candidate values ascending) that keep the global batch exactly."""
    budgeted = is_budgeted(cfg.data)
    key = "data.max_tokens_per_micro_batch" if budgeted else "train.micro_batch_size"
    total_key = "train.global_batch_tokens" if budgeted else "train.global_batch_size"
    total = cfg.train.global_batch_tokens if budgeted else cfg.train.global_batch_size
    if budgeted and not total:
        raise RecipeError(f"data.batching={cfg.data.batching} with a token budget needs train.global_batch_tokens")
    if total % ranks:
        raise RecipeError(f"{total_key}={total} is not divisible by {ranks} ranks; set a multiple of {ranks}")
    values = divisors(total // ranks)
    if budgeted:
        values = [v for v in values if v >= cfg.data.max_length]
        if not values:
            raise RecipeError(f"{total_key}={total} over {ranks} ranks is below data.max_length="
                              f"{cfg.data.max_length}: no token budget holds a longest row")
    return key, "tokens" if budgeted else "sequences", total, values


def largest_fitting(values: list[int], fits) -> int | None:
    """Index of the largest value with fits(value), assuming fitting is monotone; binary search, smallest first."""
    if not fits(values[0]):
        return None
    low, high = 0, len(values)  # values[low] fits; values[high:] do not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(values[middle]) else (low, middle)
    return low


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """(fixed, per-token) bytes by least squares over {tokens: peak}; per-token ≥ 0."""
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    return my - slope * mx, slope


def available_bytes(device) -> tuple[float, str]:
    """What this process may grow to: the GPU's memory, or its RSS plus the RAM available, shared by local ranks."""
    import psutil
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), torch.cuda.get_device_name(device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    held = psutil.Process().memory_info().rss
    room = (held + psutil.virtual_memory().available) / local
    return room, "this process + available RAM" + (f", shared by {local} local ranks" if local > 1 else "")


class Trials:
    """Real training steps of the recipe's trainer on worst-case micro-batches, with their peak memory."""

    def __init__(self, cfg: Config, smallest: int):
        import torch

        from finetune.train import build

        trial = copy.deepcopy(cfg)
        if is_budgeted(trial.data):
            trial.data.max_tokens_per_micro_batch = smallest
        else:
            trial.train.micro_batch_size = smallest
        trial.train.output_dir = tempfile.mkdtemp(prefix="finetune-plan-")
        trial.train.save_steps, trial.train.resume_from, trial.log.wandb_mode = 0, None, "disabled"
        with contextlib.redirect_stdout(io.StringIO()):  # build's start-up lines are training's, not the plan's
            self.trainer = build(trial)
        self.cfg, self.model, self.device = trial, self.trainer.model, self.trainer.args.device
        self.longest = self._longest_row()
        self.trainer.create_optimizer()
        args = self.trainer.args
        if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in trainable)
        self.on_gpu = self.device.type == "cuda"
        self.oom = torch.OutOfMemoryError
        self.warm_up = smallest  # the first step creates the optimizer state (and the trainer probes its loss head)

    def _longest_row(self) -> dict:
        dataset = self.trainer.train_dataset
        rows = dataset.rows if hasattr(dataset, "rows") else dataset  # budgeted: MicroBatches keeps the rows
        lengths = rows["input_ids"] if hasattr(rows, "column_names") else [r["input_ids"] for r in rows]
        longest = max(range(len(lengths)), key=lambda i: len(lengths[i]))
        return dict(rows[longest])

    def items(self, value: int) -> tuple[list, int]:
        """What the collator gets for a worst-case micro-batch of `value`, and its token count."""
        row, length = self.longest, len(self.longest["input_ids"])
        text = set(row) <= {"input_ids", "labels", "attention_mask"}
        if not is_budgeted(self.cfg.data):
            count, keep = value, length
        elif text:  # as many tokens as the budget holds, in rows no longer than the longest
            count = math.ceil(value / length)
            keep = value // count
        else:  # rows with images are not cut
            count, keep = max(1, value // length), length
        ids = list(row["input_ids"])[:keep]
        copy_row = {**row, "input_ids": ids, "labels": list(ids)} if text else dict(row)
        copy_row.pop("attention_mask", None)
        rows = [dict(copy_row) for _ in range(count)]
        return ([rows] if is_budgeted(self.cfg.data) else rows), count * len(copy_row["input_ids"])

    def peak(self, value: int) -> tuple[float, float]:
        """One training step at `value`: (memory before, peak memory), bytes; torch.OutOfMemoryError on a GPU."""
        import gc

        import torch

        if self.warm_up:
            smallest, self.warm_up = self.warm_up, None
            self.peak(smallest)
        items, tokens = self.items(value)
        batch = self.trainer.data_collator(items)
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        profiler = None
        if self.on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_reserved(self.device)
        else:
            before = trimmed_rss()
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            with quiet_stderr():  # kineto prints a line at every start and stop
                profiler.start()
        try:
            with self.trainer.accelerator.autocast():
                self.trainer.training_step(self.model, batch, num_items_in_batch=torch.tensor(tokens))
            self.trainer.optimizer.step()
            self.model.zero_grad(set_to_none=True)
        finally:
            if profiler:
                with quiet_stderr():
                    profiler.stop()
            self.model.zero_grad(set_to_none=True)
            del batch
        peak = torch.cuda.max_memory_reserved(self.device) if self.on_gpu else before + peak_allocation(profiler)
        return float(before), float(peak)

    def tokens(self, value: int) -> int:
        return self.items(value)[1]


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for a moment: C++ code writes there directly."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def trimmed_rss() -> float:
    """Resident memory after handing freed heap back to the OS (glibc's malloc_trim), bytes."""
    import ctypes

    import psutil

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return float(psutil.Process().memory_info().rss)


def peak_allocation(profiler) -> float:
    """The largest running total of CPU tensor allocations minus frees over a profiled region, bytes."""
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.device_type().name == "CPU":
            running += event.nbytes()
            peak = max(peak, running)
    return float(peak)


def plan(cfg: Config, ranks: int, headroom: float = HEADROOM, memory_gib: float | None = None,
         trials: Trials | None = None) -> Plan:
    from finetune import schedules

    key, unit, total, values = candidates(cfg, ranks)
    trials = trials or Trials(cfg, values[0])
    if memory_gib:
        base, base_text = memory_gib * GIB, f"plan.memory_gib={memory_gib:g}"
    else:
        base, base_text = available_bytes(trials.device)
    limit = (1 - headroom) * base
    limit_text = f"{1 - headroom:.0%} of {base / GIB:.2f} GiB, {base_text}"
    ddp = trials.gradient_bytes if ranks > 1 else 0  # DDP's gradient buckets, absent from single-process trials
    measured: dict[int, float] = {}
    before: list[float] = []  # memory when each step started

    def measure(value: int) -> float:
        try:
            start, peak = trials.peak(value)
            before.append(start)
            measured[value] = peak + ddp
        except trials.oom:
            measured[value] = math.inf
        return measured[value]

    longest = len(trials.longest["input_ids"])
    if trials.on_gpu:
        index = largest_fitting(values, lambda v: measure(v) <= limit)
        predicted = measured
        how = (f"{len(measured)} trial steps on {trials.device} at the longest row ({longest} tokens), "
               f"candidates {values}")
    else:
        # A CPU out-of-memory cannot be caught: trials run while the line through the points so far says they are
        # well within the limit, and stay small; the line, refitted over all of them, predicts the rest.
        points: dict[int, float] = {}  # tokens → bytes a step adds
        for value in values:
            fixed, per_token = fit_line(points) if points else (0.0, 0.0)
            tokens = trials.tokens(value)
            if len(points) >= 2 and (max(before) + ddp + fixed + per_token * tokens > SAFE_TRIAL * limit
                                     or tokens > CPU_TRIAL_TOKENS):
                break
            points[tokens] = measure(value) - ddp - before[-1]
            if measured[value] > limit:
                break
        step, per_token = fit_line(points)
        fixed = max(before) + ddp + step  # model, optimizer state, gradients, libraries: what every step starts from
        predicted = {v: fixed + per_token * trials.tokens(v) for v in values}
        index = largest_fitting(values, lambda v: predicted[v] <= limit)
        how = (f"cpu, {len(points)} trial steps at the longest row ({longest} tokens), RSS + peak tensor bytes: "
               f"{fixed / GIB:.2f} GiB + {per_token / 2**20:.3f} MiB per token, candidates {values}")
    if index is None:
        first = values[0]
        raise RecipeError(
            f"nothing fits: {key}={first} ({trials.tokens(first)} tokens of the longest row) "
            + ("ran out of memory" if measured[first] == math.inf else f"measured {measured[first] / GIB:.2f} GiB")
            + f", over the limit of {limit / GIB:.2f} GiB ({limit_text}); lower data.max_length, train fewer "
            "parameters (model.lora, model.freeze), set train.gradient_checkpointing=true, or use more memory"
        )
    value = values[index]
    lr = schedules.scaled_lr(cfg.optim.lr, total, cfg.optim.lr_scaling, cfg.optim.base_batch_size)
    lr_text = f"{lr:g}" + (f" ({cfg.optim.lr_scaling} rule from {cfg.optim.lr:g} at base {cfg.optim.base_batch_size})"
                           if cfg.optim.lr_scaling != "none" else " (no scaling rule; the global batch is kept)")
    return Plan(key, value, total // (value * ranks), ranks, total, unit, predicted[value], limit, limit_text, lr,
                lr_text, how, measured, predicted)


def resolve_auto_micro_batch(cfg: Config) -> None:
    """`train.micro_batch_size: auto`: plan on this machine (every rank), agree on the smallest choice, set it."""
    import gc

    import torch

    from finetune import distributed, reporting
    from finetune.config import data_parallel_ranks

    if distributed.uses_deepspeed() or distributed.uses_fsdp():
        raise RecipeError("train.micro_batch_size=auto plans memory with whole models (one process or DDP); under "
                          "DeepSpeed or FSDP set train.micro_batch_size to a number")
    ranks = data_parallel_ranks()
    result = plan(cfg, ranks)
    choice = result.value
    if torch.distributed.is_available() and torch.distributed.is_initialized() and ranks > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        agreed = torch.tensor(choice, device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)  # every rank must fit
        choice = int(agreed)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    reporting.main_print(f"train.micro_batch_size=auto → {choice} (accumulation {result.global_batch // (choice * ranks)};"
                         f" expected peak {result.peak_bytes / GIB:.2f} GiB of a {result.limit_bytes / GIB:.2f} GiB "
                         "limit)")
    cfg.train.micro_batch_size = choice


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        rest, options = split_args(argv)
        cfg = load_config(rest)
        ranks = options["ranks"] or int(os.environ.get("WORLD_SIZE", "1"))
        result = plan(cfg, ranks, options["headroom"], options["memory_gib"])
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.describe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
