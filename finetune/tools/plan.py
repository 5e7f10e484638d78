"""The largest micro-batch that fits, with the global batch kept: `python -m finetune.plan recipe=… [key=value …]`.

    python -m finetune.plan recipe=recipes/quickstart.yaml [plan.headroom=0.1] [plan.memory_gib=24] [plan.ranks=8]

Candidates are the micro-batches that divide the global batch per rank (`train.global_batch_size / ranks`, or the
token budgets ≥ data.max_length dividing `train.global_batch_tokens / ranks` for token-budgeted batching), so the
accumulation `global / (micro × ranks)` is a whole number and the global batch, hence the LR, does not change.
A trial is one real training step of the recipe's trainer (forward, backward, optimizer step; precision, LoRA,
freeze, checkpointing as recipe'd) on the worst case: copies of the dataset's longest row, every token a target
(finetune/tools/memory_trials.py runs and measures the trials; this module chooses among the candidates).

- GPU: binary search over the candidates by trials; a trial fits when it does not run out of memory and its peak
  reserved memory is within the limit.
- CPU: an out-of-memory there kills the process, so trials run only where they are clearly safe and small; each gives
  the RSS before the step plus the peak of tensor bytes the step allocated (torch's profiler: exact, where the RSS
  high-water mark also counts what the C allocator keeps), and a least-squares line in tokens predicts the rest.

With an eval set, one eval forward (no gradients) on the worst-case eval micro-batch is measured too, and the KV cache
of generating the samples added (finetune/evaluation/samples.py): the run's peak is the larger of training's and that.

The limit is (1 − plan.headroom) × (plan.memory_gib, or the GPU's memory, or this process's RSS + the RAM available),
shared by the ranks of one machine on CPU. Under several ranks the trials run without DDP, which then adds one copy
of the trainable gradients (its buckets); that copy is added to every figure. `train.micro_batch_size: auto` runs
this planner when training starts (finetune/tools/train.py), before the trainer is built.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field

from finetune import env
from finetune.recipe import (
    Config,
    RecipeError,
    RunPlan,
    check_config,
    is_budgeted,
    load_config,
    resolve_plan,
    split_tool_args,
)
from finetune.recipe.run_plan import scaled_lr
from finetune.recipe.usage import Command, ToolKey, help_asked, print_page
from finetune.tools.boundary import run_command
from finetune.tools.memory_trials import GIB, Trials, available_bytes, eval_memory, fit_line

HEADROOM = 0.10
CPU_TRIAL_TOKENS = 8192  # CPU trials stay this small: a real model's step on many thousand tokens is slow on a CPU
SAFE_TRIAL = 0.8  # a CPU trial runs only where the prediction so far is this far below the limit
COMMAND = Command(
    "finetune-plan",
    "The largest micro-batch that fits this machine with the global batch kept, by real training steps.",
    also=("python -m finetune.plan …",),
    tool="plan",
    keys=(
        ToolKey("headroom", float, f"{HEADROOM:g}", "share of the memory limit kept free, in [0, 1)"),
        ToolKey("memory_gib", float, "the GPU's memory, or RSS + available RAM", "the memory to plan for, in GiB"),
        ToolKey("ranks", int, "the launch's ranks", "ranks the global batch is split over"),
    ),
)


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
    eval_bytes: float = 0.0  # expected peak per rank while evaluating (eval micro-batch, then the generate KV cache)
    eval_text: str = ""

    def describe(self) -> str:
        per = f"{self.value} {self.unit}" if self.unit == "tokens" else f"{self.value}"
        return "\n".join(
            [
                f"plan: {self.how}",
                f"  limit {self.limit_bytes / GIB:.2f} GiB ({self.limit_text})",
                f"  micro-batch {per}, accumulation {self.accumulation}, "
                f"{self.ranks} rank{'s' if self.ranks != 1 else ''}"
                f" → global batch {self.global_batch} {self.unit} (kept)",
                f"  expected peak memory {self.peak_bytes / GIB:.2f} GiB per rank",
                *([f"  eval: {self.eval_text}"] if self.eval_text else []),
                f"  lr {self.lr_text}",
                f"  set: {self.key}={self.value}",
            ]
        )


def split_args(argv: list[str]) -> tuple[list[str], dict]:
    """(recipe arguments, plan options): plan.* keys are this tool's, not the recipe's."""
    rest, given = split_tool_args(argv, "plan", {key.name: key.parse for key in COMMAND.keys})
    options = {"headroom": HEADROOM, "memory_gib": None, "ranks": None, **given}
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
            raise RecipeError(
                f"{total_key}={total} over {ranks} ranks is below data.max_length="
                f"{cfg.data.max_length}: no token budget holds a longest row"
            )
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


class Measured:
    """Peak bytes of the trial steps so far (inf where one ran out of memory) and the memory each step started from."""

    def __init__(self, trials: Trials, ddp: float):
        self.trials, self.ddp = trials, ddp
        self.peaks: dict[int, float] = {}
        self.before: list[float] = []

    def measure(self, value: int) -> float:
        try:
            start, peak = self.trials.peak(value)
            self.before.append(start)
            self.peaks[value] = peak + self.ddp
        except self.trials.oom:
            self.peaks[value] = math.inf
        return self.peaks[value]


def plan_on_gpu(trials: Trials, values: list[int], limit: float, runs: Measured):
    """(predicted bytes per candidate, the index that fits, how): a real step per candidate tried, bisecting."""
    index = largest_fitting(values, lambda v: runs.measure(v) <= limit)
    longest = len(trials.longest["input_ids"])
    return (
        runs.peaks,
        index,
        f"{len(runs.peaks)} trial steps on {trials.device} at the longest row ({longest} tokens), candidates {values}",
    )


def plan_on_cpu(trials: Trials, values: list[int], limit: float, runs: Measured):
    """A CPU out-of-memory cannot be caught: trials run while the line through the points so far says they are well
    within the limit, and stay small; the line, refitted over all of them, predicts the rest."""
    points: dict[int, float] = {}  # tokens → bytes a step adds
    for value in values:
        fixed, per_token = fit_line(points) if points else (0.0, 0.0)
        tokens = trials.tokens(value)
        expected = (max(runs.before) if runs.before else 0.0) + runs.ddp + fixed + per_token * tokens
        if len(points) >= 2 and (expected > SAFE_TRIAL * limit or tokens > CPU_TRIAL_TOKENS):
            break
        points[tokens] = runs.measure(value) - runs.ddp - runs.before[-1]
        if runs.peaks[value] > limit:
            break
    step, per_token = fit_line(points)
    fixed = (
        max(runs.before) + runs.ddp + step
    )  # model, optimizer state, gradients, libraries: what every step starts from
    predicted = {v: fixed + per_token * trials.tokens(v) for v in values}
    index = largest_fitting(values, lambda v: predicted[v] <= limit)
    longest = len(trials.longest["input_ids"])
    how = (
        f"cpu, {len(points)} trial steps at the longest row ({longest} tokens), RSS + peak tensor bytes: "
        f"{fixed / GIB:.2f} GiB + {per_token / 2**20:.3f} MiB per token, candidates {values}"
    )
    return predicted, index, how


def nothing_fits(key: str, first: int, trials: Trials, measured: dict, limit: float, limit_text: str) -> RecipeError:
    return RecipeError(
        f"nothing fits: {key}={first} ({trials.tokens(first)} tokens of the longest row) "
        + ("ran out of memory" if measured[first] == math.inf else f"measured {measured[first] / GIB:.2f} GiB")
        + f", over the limit of {limit / GIB:.2f} GiB ({limit_text}); lower data.max_length, train fewer "
        "parameters (model.lora, model.freeze), set train.gradient_checkpointing=true, or use more memory"
    )


def planned_lr(cfg: Config, total: int) -> tuple[float, str]:
    o = cfg.optim
    lr = scaled_lr(o.lr, total, o.lr_scaling, o.base_batch_size)
    rule = f" ({o.lr_scaling} rule from {o.lr:g} at base {o.base_batch_size})" if o.lr_scaling != "none" else ""
    return lr, f"{lr:g}" + (rule or " (no scaling rule; the global batch is kept)")


def plan(
    cfg: Config, ranks: int, headroom: float = HEADROOM, memory_gib: float | None = None, trials: Trials | None = None
) -> Plan:
    key, unit, total, values = candidates(cfg, ranks)
    if trials is None:
        with Trials(cfg, values[0]) as own:  # its trainer and temporary output folder go once the plan is made
            return plan(cfg, ranks, headroom, memory_gib, own)
    if memory_gib:
        base, base_text = memory_gib * GIB, f"plan.memory_gib={memory_gib:g}"
    else:
        base, base_text = available_bytes(trials.device)
    limit = (1 - headroom) * base
    limit_text = f"{1 - headroom:.0%} of {base / GIB:.2f} GiB, {base_text}"
    runs = Measured(trials, trials.gradient_bytes if ranks > 1 else 0)  # + DDP's gradient buckets on several ranks
    predicted, index, how = (plan_on_gpu if trials.on_gpu else plan_on_cpu)(trials, values, limit, runs)
    if index is None:
        raise nothing_fits(key, values[0], trials, runs.peaks, limit, limit_text)
    value = values[index]
    lr, lr_text = planned_lr(cfg, total)
    eval_bytes, eval_text = eval_memory(trials, runs.ddp, limit, limit_text)
    peak = max(predicted[value], eval_bytes)
    return Plan(
        key, value, total // (value * ranks), ranks, total, unit, peak, limit, limit_text, lr, lr_text, how,
        runs.peaks, predicted, eval_bytes, eval_text,
    )  # fmt: skip


def resolve_auto_micro_batch(cfg: Config) -> tuple[Config, RunPlan]:
    """`train.micro_batch_size: auto`: plan on this machine (every rank), agree on the smallest choice; a new config
    with that number, checked again (`cfg` itself is left as loaded), and its run plan."""
    import gc

    import torch

    from finetune.training import distributed, reporting

    if distributed.uses_deepspeed() or distributed.uses_fsdp():
        raise RecipeError(
            "train.micro_batch_size=auto plans memory with whole models (one process or DDP); under "
            "DeepSpeed or FSDP set train.micro_batch_size to a number"
        )
    ranks = env.world_size()
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
    accumulation = result.global_batch // (choice * ranks)
    reporting.main_print(
        f"train.micro_batch_size=auto → {choice} (accumulation {accumulation}; expected peak "
        f"{result.peak_bytes / GIB:.2f} GiB of a {result.limit_bytes / GIB:.2f} GiB limit)"
    )
    resolved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=choice))
    check_config(resolved)
    return resolved, resolve_plan(resolved, ranks)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        if (text := help_asked(argv, COMMAND)) is not None:
            print_page(text)
            return 0
        rest, options = split_args(argv)
        cfg = load_config(rest)
        ranks = options["ranks"] or env.world_size()
        print(plan(cfg, ranks, options["headroom"], options["memory_gib"]).describe(), flush=True)
        return 0

    return run_command(body)  # one `error:` line for what the user can fix, a traceback for a bug
