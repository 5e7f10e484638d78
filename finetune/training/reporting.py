"""What a run shows: W&B set-up, start-up lines, a step-count check, timings.jsonl and the profiler; the console's
step and evaluation lines and its progress bar are console.py's, the end-of-run figures and table run_summary.py's."""

from __future__ import annotations

import functools
import glob
import json
import netrc
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import torch
from transformers import TrainerCallback
from transformers.integrations import WandbCallback

from finetune.core.meter import TIMING_KEYS
from finetune.env import is_main_process
from finetune.recipe import LogConfig, RecipeError, TrainConfig
from finetune.training.console import StepProgress


def main_print(line: str) -> None:
    if is_main_process():
        print(line, flush=True)


def has_accelerator() -> bool:
    return torch.cuda.is_available()


WANDB_ANSWER_S = 3.0  # how long log.wandb_mode=auto/online waits for the W&B service to answer


def has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(urllib.parse.urlparse(wandb_url()).hostname or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_url() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")


@functools.lru_cache(maxsize=4)
def wandb_answer(url: str) -> str | None:
    """None when the W&B service at `url` answers an HTTP request within WANDB_ANSWER_S (any status), else why not.
    Asked once per process: every rank and call site then agrees on the mode."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=WANDB_ANSWER_S).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{url} did not answer within {WANDB_ANSWER_S:g} s ({reason})"
    return None


def wandb_mode(log: LogConfig) -> str:
    """log.wandb_mode, with auto resolved: online when an API key is found and the service answers, else offline."""
    if log.wandb_mode != "auto":
        return log.wandb_mode
    return "online" if has_wandb_key() and wandb_answer(wandb_url()) is None else "offline"


def parameters_line(model: torch.nn.Module) -> str:
    """`parameters: 1,843,200 trainable of 136,358,400 (1.35 %)`: each parameter once (tied weights are one), at its
    full size (ZeRO-3's ds_numel for a partitioned one)."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / max(total, 1):.2f} %)"


def configure_wandb(log: LogConfig, train: TrainConfig) -> None:
    """W&B runs land under the output directory; offline runs need no key and upload later with `wandb sync`.
    online without a key or an answering service is a RecipeError (nothing is written); auto falls back to offline
    with one warning when it has a key but no answer."""
    if log.wandb_mode == "online" and not has_wandb_key():
        raise RecipeError(
            "log.wandb_mode=online needs a W&B API key (WANDB_API_KEY, or `wandb login`); log in, or set "
            "log.wandb_mode=offline (upload later with `wandb sync`)"
        )
    if log.wandb_mode in ("online", "auto") and has_wandb_key() and (why := wandb_answer(wandb_url())):
        if log.wandb_mode == "online":
            raise RecipeError(
                f"log.wandb_mode=online: the W&B service {why}; check the network (or "
                "WANDB_BASE_URL), or set log.wandb_mode=offline (upload later with `wandb sync`)"
            )
        if is_main_process():
            print(
                f"warning: log.wandb_mode=auto: the W&B service {why}; logging offline (upload later with "
                "`wandb sync`)",
                file=sys.stderr,
                flush=True,
            )
    mode = wandb_mode(log)
    os.environ["WANDB_MODE"] = mode
    if mode == "disabled":
        return
    os.environ["WANDB_PROJECT"] = log.wandb_project
    os.environ.setdefault("WANDB_DIR", os.path.abspath(train.output_dir))
    os.environ.setdefault("WANDB_SILENT", "true")


def wandb_run_dir(output_dir: str) -> str | None:
    runs = sorted(glob.glob(os.path.join(os.environ.get("WANDB_DIR", output_dir), "wandb", "*run-*")))
    return runs[-1] if runs else None


class StepCountCheck(TrainerCallback):
    """The schedule was built for `total_steps`; the Trainer must run exactly that many optimizer steps."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps != self.total_steps:
            raise RuntimeError(
                f"the schedule was built for {self.total_steps} optimizer steps but the Trainer plans {state.max_steps}"
            )


class TimingLog(TrainerCallback):
    """timings.jsonl on rank 0: per logged step its tokens/s, samples/s, peak memory and MFU, per evaluation its eval
    tokens/s; the figures trainer_state.json leaves out (a resumed run could not reproduce them). Kept in memory and
    written whole into each checkpoint-N and, with the final save, into train.output_dir (`text()`), so a run that
    stops with an error leaves no file of its own behind; a resumed run keeps the lines its checkpoint holds."""

    KEYS = (*TIMING_KEYS, "eval_tokens_per_s")

    NAME = "timings.jsonl"

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, self.NAME)
        self.lines: list[str] = []

    def checkpoint_file(self, step: int) -> str:
        return os.path.join(self.output_dir, f"checkpoint-{step}", self.NAME)

    def on_train_begin(self, args, state, control, **kwargs):
        self.lines = []
        saved = self.checkpoint_file(state.global_step)
        if state.global_step > 0 and os.path.isfile(saved):  # resumed: the steps its checkpoint holds
            with open(saved) as f:
                self.lines = [line for line in f if json.loads(line)["step"] <= state.global_step]

    def on_log(self, args, state, control, logs=None, **kwargs):
        figures = {key: logs[key] for key in self.KEYS if (logs or {}).get(key) is not None}
        if state.is_world_process_zero and figures:
            self.lines.append(json.dumps({"step": state.global_step, **figures}) + "\n")

    def files_for_checkpoint(self) -> dict[str, str]:  # RecipeTrainer's run_files: each checkpoint-N, the final save
        return {self.NAME: self.text()}

    def text(self) -> str:
        return "".join(self.lines)


class RecipeWandbCallback(WandbCallback):
    """W&B on rank 0: the whole resolved recipe (`recipe`, as a tree of plain values) as the run config, and the
    end-of-run table as the run summary."""

    def __init__(self, recipe: dict):
        super().__init__()
        self.recipe = recipe

    def setup(self, args, state, model, **kwargs):
        super().setup(args, state, model, **kwargs)
        if state.is_world_process_zero and self._wandb is not None and self._wandb.run is not None:
            self._wandb.config.update({"recipe": self.recipe}, allow_val_change=True)

    def finish(self, summary: dict) -> None:
        if self._wandb is not None and self._wandb.run is not None:
            self._wandb.run.summary.update(summary)
            self._wandb.finish()


class ProfileSteps(TrainerCallback):
    """torch.profiler over optimizer steps [first, last]: a table and a Chrome trace in the output directory."""

    def __init__(self, first: int, last: int, output_dir: str):
        self.first, self.last, self.output_dir = first, last, output_dir
        self.profiler = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.profiler is None and state.global_step + 1 == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None or state.global_step != self.last:
            return
        self.profiler.__exit__(None, None, None)
        if state.is_world_process_zero:
            os.makedirs(self.output_dir, exist_ok=True)
            stem = os.path.join(self.output_dir, f"profile_steps_{self.first}-{self.last}")
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            with open(stem + ".txt", "w") as f:
                f.write(self.profiler.key_averages().table(sort_by=sort, row_limit=40))
            self.profiler.export_chrome_trace(stem + ".trace.json")
            main_print(
                f"profile of steps {self.first}-{self.last}: {stem}.txt and {stem}.trace.json (chrome://tracing)"
            )
        self.profiler = None


@dataclass
class RunReports:
    """What a recipe run adds to the Trainer's callbacks (`callbacks`; StepProgress replaces the Trainer's own progress
    bar), and by name the two others use: `timings` (its file goes into every checkpoint and the final save) and
    `wandb` (given the end-of-run figures; None when log.wandb_mode=disabled)."""

    callbacks: list[TrainerCallback]
    timings: TimingLog
    wandb: RecipeWandbCallback | None


def reports(train: TrainConfig, log: LogConfig, recipe: dict) -> RunReports:
    """`recipe`: the whole resolved recipe as a tree of plain values (W&B's run config)."""
    progress, timings = StepProgress(), TimingLog(train.output_dir)
    wandb = RecipeWandbCallback(recipe) if wandb_mode(log) != "disabled" else None
    added: list[TrainerCallback] = [progress, timings, *([wandb] if wandb else [])]
    if train.profile_steps:
        added.append(ProfileSteps(*train.profile_steps, train.output_dir))
    return RunReports(added, timings, wandb)
