"""The console during training: one whole line per logged optimizer step and per evaluation, and in a terminal one
progress bar under them (`StepProgress`); where stderr is no terminal, no bar at all (`plain_console` quiets the
libraries' bars too), so a log file holds whole lines only."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import has_length

from finetune.evaluation import metrics

STEP_FIELDS = [  # (log key, label, format) of the one console line per logged optimizer step
    ("loss", "loss", "{:.4f}"),
    ("learning_rate", "lr", "{:.3g}"),
    ("grad_norm", "grad_norm", "{:.3g}"),
    ("window_label_tokens", "targets", "{:.0f}"),
    ("real_tokens_per_s", "tok/s", "{:.0f}"),
    ("padding_efficiency", "real", "{:.0%}"),
    ("balance_loss", "balance", "{:.4g}"),  # a mixture of experts' router balancing term (finetune/core/meter.py)
    ("expert_load", "load", "{:.2f}"),  # its busiest expert's routing share ÷ the mean, in the worst layer
    ("mfu", "mfu", "{:.1%}"),
    ("peak_mem_mb", "mem", "{:.0f} MB"),
]


def step_line(logs: dict, step: int, max_steps: int) -> str:
    fields = [f"{label} {fmt.format(logs[key])}" for key, label, fmt in STEP_FIELDS if logs.get(key) is not None]
    if logs.get("nonfinite_skipped"):  # only once a step was skipped (train.on_nonfinite=skip)
        fields.append(f"skipped {logs['nonfinite_skipped']} non-finite")
    return f"step {step}/{max_steps}  " + "  ".join(fields)


class StepProgress(ProgressCallback):
    """One line per logged optimizer step and per evaluation (stdout); in a terminal, one progress bar under them
    (stderr: ETA and tokens/s; an evaluation's batches on the same bar, so no second bar ever interleaves with the
    lines). Without a terminal (a log file, a pipe) no bar at all: every line is whole, with no carriage returns or
    cursor moves. `bar`: force the bar on or off (default: whether stderr is a terminal)."""

    def __init__(self, bar: bool | None = None):
        super().__init__()
        self.bar = bar
        self.current_step = 0
        self.eval_batches = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = state.global_step
        if state.is_world_process_zero and (sys.stderr.isatty() if self.bar is None else self.bar):
            self.training_bar = tqdm(
                total=state.max_steps, initial=state.global_step, unit="step", dynamic_ncols=True, leave=False
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.set_description_str("", refresh=False)  # an evaluation a stop request ended, too
            self.training_bar.update(state.global_step - self.current_step)
        self.current_step = state.global_step

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if self.training_bar is not None and has_length(eval_dataloader):
            self.eval_batches += 1
            self.training_bar.set_description_str(f"eval {self.eval_batches}/{len(eval_dataloader)}")

    def on_evaluate(self, args, state, control, **kwargs):
        self.eval_batches = 0
        if self.training_bar is not None:
            self.training_bar.set_description_str("")

    on_predict = on_evaluate

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs and "grad_norm" in logs:
            self.write(step_line(logs, state.global_step, state.max_steps))
            if self.training_bar is not None and logs.get("real_tokens_per_s") is not None:
                self.training_bar.set_postfix_str(f"{logs['real_tokens_per_s']:.0f} tok/s")
        elif "eval_loss" in logs:
            self.write(metrics.eval_line(logs, state.global_step, state.max_steps))

    def write(self, line: str) -> None:
        """A whole line above the bar (tqdm clears and redraws it), or a plain line without one."""
        if self.training_bar is not None:
            tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


def plain_console() -> None:
    """No library progress bars (transformers' weight loading, datasets) where stderr is no terminal: in a log file
    each redraw is a fragment of a line."""
    if sys.stderr.isatty():
        return
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
