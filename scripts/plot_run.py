"""Plot a run: loss, learning rate, gradient norm and tokens/s per optimizer step, in one PNG.

    python scripts/plot_run.py OUTPUT_DIR [out=PATH]

Reads OUTPUT_DIR/trainer_state.json (written at the end of every run; while a run is going, the newest
checkpoint-N/trainer_state.json is used), one log_history entry per logged optimizer step. The PNG goes to
OUTPUT_DIR/run.png unless `out=` says otherwise. Tokens/s is the logged `real_tokens_per_s` (tokens that are not
padding), with `computed_tokens_per_s` (padding included) beside it when logged; a run that logged neither gets an
empty panel that says so.
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
    ("tokens/s (all ranks)", [("real_tokens_per_s", "real tokens/s", "-"),
                              ("computed_tokens_per_s", "computed tokens/s (with padding)", "--")]),
)


class PlotError(ValueError):
    """Printed as one line, exit code 2."""


def state_file(output_dir: str) -> str:
    path = os.path.join(output_dir, "trainer_state.json")
    if os.path.isfile(path):
        return path
    checkpoints = glob.glob(os.path.join(output_dir, "checkpoint-*", "trainer_state.json"))
    if checkpoints:  # a run in progress: its newest checkpoint
        return max(checkpoints, key=lambda p: int(re.search(r"checkpoint-(\d+)", p).group(1)))
    raise PlotError(f"{output_dir}: no trainer_state.json (nor checkpoint-N/trainer_state.json); give a run's "
                    "train.output_dir")


def load_steps(output_dir: str) -> list[dict]:
    """The log_history entries of optimizer steps (not the end-of-training summary), in step order."""
    path = state_file(output_dir)
    try:
        history = json.load(open(path))["log_history"]
    except (OSError, ValueError, KeyError) as e:
        raise PlotError(f"{path}: not a trainer_state.json with a log_history ({e})") from None
    logged = (e for e in history if "loss" in e and "step" in e and "train_loss" not in e)
    steps = sorted(logged, key=lambda e: e["step"])
    if not steps:
        raise PlotError(f"{path}: no optimizer step was logged yet")
    return steps


def figure(steps: list[dict], title: str):
    """A 2 × 2 matplotlib figure, one panel per PANELS entry; a series nobody logged is left out, with a note."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (panel_title, series) in zip(axes.flat, PANELS):
        drawn = 0
        for key, label, style in series:
            points = [(e["step"], e[key]) for e in steps if isinstance(e.get(key), (int, float))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker="." if len(xs) <= 100 else None, linewidth=1.2, label=label)
                drawn += 1
        if drawn > 1:
            ax.legend(fontsize=8)
        if not drawn:
            keys = " / ".join(key for key, _, _ in series)
            ax.text(0.5, 0.5, f"not logged in this run\n({keys})", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
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
        steps = load_steps(output_dir)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = options.get("out") or os.path.join(output_dir, "run.png")
    fig = figure(steps, f"{os.path.basename(os.path.abspath(output_dir))}: {len(steps)} logged optimizer steps")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
