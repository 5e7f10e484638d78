"""Plot a run: loss (and the held-out eval loss), learning rate, gradient norm and tokens/s per optimizer step, in one
PNG.

    python scripts/plot_run.py OUTPUT_DIR [out=PATH]

Reads OUTPUT_DIR/trainer_state.json (written at the end of every run; while a run is going, the newest
checkpoint-N/trainer_state.json is used): one log_history entry per logged optimizer step, and one per evaluation
(`eval_loss`, drawn beside the training loss). Tokens/s is measured, so trainer_state.json does not hold it (a resumed
run must reproduce that file exactly): it comes from OUTPUT_DIR/timings.jsonl, which a run appends per logged step
(`real_tokens_per_s`, tokens that are not padding, and `computed_tokens_per_s`, padding included) and per evaluation
(`eval_tokens_per_s`). A run without that file gets an empty panel that says so. The PNG goes to OUTPUT_DIR/run.png
unless `out=` says otherwise.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

PANELS = (  # (title, [(log key, label, style)])
    ("loss (token mean over the window)", [("loss", "loss", "-")]),
    ("learning rate", [("learning_rate", "learning rate", "-")]),
    ("gradient norm before clipping", [("grad_norm", "grad norm", "-")]),
    (
        "tokens/s (all ranks)",
        [
            ("real_tokens_per_s", "real tokens/s", "-"),
            ("computed_tokens_per_s", "computed tokens/s (with padding)", "--"),
        ],
    ),
)
EVAL_SERIES = {  # panel index → (key of an evaluation's entry, label, style): drawn over the step series
    0: ("eval_loss", "eval loss (held out, token mean of the eval set)", "--"),
    3: ("eval_tokens_per_s", "eval tokens/s (forward only)", ":"),
}
TIMINGS = "timings.jsonl"


class PlotError(ValueError):
    """Printed as one line, exit code 2."""


def state_file(output_dir: str) -> str:
    path = os.path.join(output_dir, "trainer_state.json")
    if os.path.isfile(path):
        return path
    checkpoints = glob.glob(os.path.join(output_dir, "checkpoint-*", "trainer_state.json"))
    if checkpoints:  # a run in progress: its newest checkpoint
        return max(checkpoints, key=lambda p: int(re.search(r"checkpoint-(\d+)", p).group(1)))
    raise PlotError(
        f"{output_dir}: no trainer_state.json (nor checkpoint-N/trainer_state.json); give a run's train.output_dir"
    )


def load_history(output_dir: str) -> tuple[str, list[dict]]:
    path = state_file(output_dir)
    try:
        return path, json.load(open(path))["log_history"]
    except (OSError, ValueError, KeyError) as e:
        raise PlotError(f"{path}: not a trainer_state.json with a log_history ({e})") from None


def load_timings(output_dir: str) -> tuple[dict[int, dict], dict[int, dict]]:
    """({step: step timings}, {step: eval timings}) from timings.jsonl; a step written twice (a resumed run): the last
    line. Empty without the file."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    # beside trainer_state.json: the output folder's at the end of a run, else the newest checkpoint's
    path = os.path.join(os.path.dirname(state_file(output_dir)), TIMINGS)
    if not os.path.isfile(path):
        return steps, evals
    for line in open(path):
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            (evals if "eval_tokens_per_s" in entry else steps)[entry["step"]] = entry
    return steps, evals


def load_steps(output_dir: str) -> list[dict]:
    """The log_history entries of optimizer steps (not the end-of-training summary), in step order, with their
    timings.jsonl figures."""
    path, history = load_history(output_dir)
    timings = load_timings(output_dir)[0]
    logged = (e for e in history if "loss" in e and "step" in e and "train_loss" not in e)
    steps = sorted(({**timings.get(e["step"], {}), **e} for e in logged), key=lambda e: e["step"])
    if not steps:
        raise PlotError(f"{path}: no optimizer step was logged yet")
    return steps


def load_evals(output_dir: str) -> list[dict]:
    """The log_history entries of evaluations, in step order, with their eval tokens/s from timings.jsonl."""
    timings = load_timings(output_dir)[1]
    evals = (e for e in load_history(output_dir)[1] if "eval_loss" in e and "step" in e)
    return sorted(({**timings.get(e["step"], {}), **e} for e in evals), key=lambda e: e["step"])


def figure(steps: list[dict], title: str, evals: list[dict] = ()):
    """A 2 × 2 matplotlib figure, one panel per PANELS entry, with the evaluations' series (EVAL_SERIES) over them; a
    series nobody logged is left out, with a note."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for index, (ax, (panel_title, series)) in enumerate(zip(axes.flat, PANELS)):
        drawn = 0
        sources = [(steps, s) for s in series] + ([(evals, EVAL_SERIES[index])] if index in EVAL_SERIES else [])
        for entries, (key, label, style) in sources:
            points = [(e["step"], e[key]) for e in entries if isinstance(e.get(key), (int, float))]
            if points:
                xs, ys = zip(*points)
                marker = "o" if entries is evals else "." if len(xs) <= 100 else None
                ax.plot(xs, ys, style, marker=marker, linewidth=1.2, label=label)
                drawn += 1
        if drawn > 1:
            ax.legend(fontsize=8)
        if not drawn:
            keys = " / ".join(key for key, _, _ in series)
            ax.text(
                0.5,
                0.5,
                f"not logged in this run\n({keys})",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
        ax.set_title(panel_title, fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)
    try:
        if len(positional) != 1 or set(options) - {"out"}:
            raise PlotError("usage: python scripts/plot_run.py OUTPUT_DIR [out=PATH]")
        output_dir = positional[0]
        steps, evals = load_steps(output_dir), load_evals(output_dir)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = options.get("out") or os.path.join(output_dir, "run.png")
    title = f"{os.path.basename(os.path.abspath(output_dir))}: {len(steps)} logged optimizer steps"
    fig = figure(steps, title + (f", {len(evals)} evaluations" if evals else ""), evals)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
