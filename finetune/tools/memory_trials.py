"""Memory trials for the planner: real training steps on worst-case micro-batches, and the memory they take.

`Trials` builds the recipe's trainer once (`finetune.assemble.build`, as training builds it, with its output in a
temporary folder removed on `close()` or when used as a context manager) and runs one training step (forward, backward,
optimizer step) on copies of the dataset's longest row, every token a target. On a GPU a step reports its peak
reserved memory (an out-of-memory raises `torch.OutOfMemoryError`); on CPU the RSS before the step (after glibc hands
freed heap back) plus the peak of tensor bytes the step allocated, from torch's profiler. `fit_line` turns CPU
measurements into fixed + per-token bytes; `available_bytes` is what the process may grow to; `eval_memory` is an
evaluation's expected peak.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import tempfile
from dataclasses import replace

from finetune import env
from finetune.recipe import Config, RecipeError, is_budgeted

GIB = 2**30


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
    local = env.local_world_size()
    held = psutil.Process().memory_info().rss
    room = (held + psutil.virtual_memory().available) / local
    return room, "this process + available RAM" + (f", shared by {local} local ranks" if local > 1 else "")


class Trials:
    """Real training steps of the recipe's trainer on worst-case micro-batches, with their peak memory."""

    def __init__(self, cfg: Config, smallest: int):
        import torch

        from finetune.assemble import build

        self._output = tempfile.TemporaryDirectory(prefix="finetune-plan-")  # removed by close(), else when collected
        budgeted = is_budgeted(cfg.data)
        trial = replace(
            cfg,
            data=replace(cfg.data, max_tokens_per_micro_batch=smallest) if budgeted else cfg.data,
            train=replace(
                cfg.train,
                micro_batch_size=cfg.train.micro_batch_size if budgeted else smallest,
                output_dir=self._output.name,
                save_steps=0,
                resume_from=None,
            ),
            log=replace(cfg.log, wandb_mode="disabled"),
        )
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

    def close(self) -> None:
        """Remove the trial trainer's temporary output folder."""
        self._output.cleanup()

    def __enter__(self) -> Trials:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    @contextlib.contextmanager
    def measured(self):
        """Memory around what runs inside, gradients freed first: yields {"before": bytes}, adds "peak" on success."""
        import gc

        import torch

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
        figures = {"before": float(before)}
        try:
            yield figures
        finally:
            if profiler:
                with quiet_stderr():
                    profiler.stop()
        peak = torch.cuda.max_memory_reserved(self.device) if self.on_gpu else before + peak_allocation(profiler)
        figures["peak"] = float(peak)

    def peak(self, value: int) -> tuple[float, float]:
        """One training step at `value`: (memory before, peak memory), bytes; torch.OutOfMemoryError on a GPU."""
        import torch

        if self.warm_up:
            smallest, self.warm_up = self.warm_up, None
            self.peak(smallest)
        items, tokens = self.items(value)
        batch = self.trainer.data_collator(items)
        try:
            with self.measured() as figures:
                with self.trainer.accelerator.autocast():
                    self.trainer.training_step(self.model, batch, num_items_in_batch=torch.tensor(tokens))
                self.trainer.optimizer.step()
        finally:
            self.model.zero_grad(set_to_none=True)
            del batch
        return figures["before"], figures["peak"]

    def tokens(self, value: int) -> int:
        return self.items(value)[1]

    # ---- evaluation: a forward without gradients, then generation ----

    def eval_items(self) -> tuple[list, int, int]:
        """The worst-case eval micro-batch (copies of the eval set's longest row, eval.micro_batch_size of them or as
        many as eval.max_tokens_per_micro_batch holds), as its collator takes it; (items, rows, tokens)."""
        rows = self.trainer.eval_dataset.rows
        row = dict(max(rows, key=lambda r: len(r["input_ids"])))
        length, budget = len(row["input_ids"]), self.cfg.eval.max_tokens_per_micro_batch
        count = max(1, budget // length) if budget else self.cfg.eval.micro_batch_size
        return [[dict(row) for _ in range(count)]], count, count * length

    def eval_peak(self) -> tuple[float, float]:
        """One eval forward (no gradients, eval mode) on the worst-case eval micro-batch, as the Trainer's evaluation
        loop runs it: (memory before, peak memory), bytes; torch.OutOfMemoryError on a GPU."""
        batch = self.trainer.eval_setup.collator(self.eval_items()[0])
        try:
            with self.measured() as figures:  # between optimizer steps the gradients are gone
                self.model.eval()
                self.trainer.prediction_step(self.model, batch, prediction_loss_only=True)
        finally:
            self.model.train()
            del batch
        return figures["before"], figures["peak"]

    def kv_cache_bytes(self) -> tuple[float, int]:
        """(bytes, tokens) of the KV cache generating a sample from the longest sample prompt: keys and values of
        every layer for the prompt and eval.max_new_tokens."""
        evaluating = self.trainer.eval_callbacks
        if evaluating is None or evaluating.samples is None:
            return 0.0, 0
        prompt = max(p.inputs["input_ids"].shape[1] for p in evaluating.samples.prompts)
        tokens = prompt + self.cfg.eval.max_new_tokens
        config = self.model.config.get_text_config()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        width = next(self.model.parameters()).element_size()
        return 2.0 * config.num_hidden_layers * kv_heads * head_dim * tokens * width, tokens


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


def eval_memory(trials: Trials, ddp: float, limit: float, limit_text: str) -> tuple[float, str]:
    """(expected peak bytes, a line) of an evaluation: a forward without gradients on the worst-case eval micro-batch
    (measured), and the KV cache of generating a sample (computed); a RecipeError when it does not fit."""
    if getattr(trials.trainer, "eval_setup", None) is None:
        return 0.0, ""
    _, rows, tokens = trials.eval_items()
    try:
        before, peak = trials.eval_peak()
    except trials.oom:
        before, peak = 0.0, math.inf
    cache, cache_tokens = trials.kv_cache_bytes()
    expected = max(peak, before + cache) + ddp
    if expected > limit:
        raise RecipeError(
            f"evaluation does not fit: the eval micro-batch of {rows} rows ({tokens} tokens of the longest eval row) "
            + ("ran out of memory" if peak == math.inf else f"needs {expected / GIB:.2f} GiB")
            + f", over the limit of {limit / GIB:.2f} GiB ({limit_text}); lower eval.micro_batch_size or "
            "eval.max_tokens_per_micro_batch"
        )
    return expected, (
        f"micro-batch of {rows} rows ({tokens} tokens of the longest eval row), no gradients: expected "
        f"peak {expected / GIB:.2f} GiB per rank, measured; generate KV cache {cache / 2**20:.1f} MiB "
        f"({cache_tokens} tokens of the longest sample prompt + eval.max_new_tokens)"
    )
