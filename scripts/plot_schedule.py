"""Plot a recipe's learning rate per optimizer step, to see warmup, peak and decay before spending a GPU hour.

    python scripts/plot_schedule.py recipe=recipes/quickstart.yaml schedule.name=onecycle [out=lr.png] [ranks=8]

Any recipe key can be overridden as in training. `out` is the PNG to write (default lr_schedule.png); `ranks` is the
number of data-parallel ranks the run will use (default: $WORLD_SIZE or 1), which sets the accumulation and, for
epoch-based runs, the number of steps. The run length is train.max_steps, or else it is counted from the tokenized
dataset exactly as training counts it (the tokenizer and the data are loaded; the model is not). The curve comes from
the real scheduler (`finetune.training.schedules.lr_per_step`) and shows the LR each optimizer step uses, as training
logs it.
"""

from __future__ import annotations

import os
import sys

SCRIPT_KEYS = ("out", "ranks")


def count_steps_from_data(cfg, plan) -> int:
    from finetune.data import batching
    from finetune.data.text import load_sft_dataset
    from finetune.model.loading import load_tokenizer, model_folder

    tokenizer = load_tokenizer(cfg.model, model_folder(cfg.model))
    dataset, report = load_sft_dataset(cfg.data, tokenizer)
    print(f"data: {report.summary()}")
    batches = batching.prepare(plan.training, dataset, tokenizer, cfg.train.seed)
    return batching.count_optimizer_steps(cfg.train, batches, plan.ranks, plan.accumulation)


def plot(lrs: list[float], title: str, out: str) -> None:
    import matplotlib

    from finetune.training.schedules import format_lr

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = range(1, len(lrs) + 1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, lrs, marker="." if len(lrs) <= 200 else None, linewidth=1.5)
    peak = max(range(len(lrs)), key=lrs.__getitem__)
    ax.axvline(peak + 1, color="grey", linestyle=":", linewidth=1)
    ax.annotate(
        f"peak {format_lr(lrs[peak])} at step {peak + 1}",
        (peak + 1, lrs[peak]),
        textcoords="offset points",
        xytext=(6, -12),
        fontsize=9,
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    from finetune import env
    from finetune.recipe import RecipeError, load_config, resolve_plan
    from finetune.training.schedules import format_lr, lr_per_step, startup_line

    options = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in SCRIPT_KEYS}
    recipe_args = [a for a in argv if a.split("=", 1)[0] not in SCRIPT_KEYS]
    out = options.get("out", "lr_schedule.png")
    try:
        ranks_text = options.get("ranks", str(env.world_size()))
        if not ranks_text.isdigit() or int(ranks_text) < 1:
            raise RecipeError(f"ranks={ranks_text} must be a positive whole number of data-parallel ranks")
        ranks = int(ranks_text)
        os.environ["WORLD_SIZE"] = str(ranks)  # load_config checks the batch arithmetic for this many ranks
        cfg = load_config(recipe_args)
        plan = resolve_plan(cfg, ranks)
        accumulation = plan.accumulation
        total = cfg.train.max_steps if cfg.train.max_steps > 0 else count_steps_from_data(cfg, plan)
        lrs = lr_per_step(total, cfg.schedule, plan.peak_lr)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(startup_line(cfg.train, cfg.data, cfg.optim, plan, total))
    recipe = os.path.basename(cfg.recipe) if cfg.recipe else "defaults"
    title = (
        f"{recipe}: schedule {cfg.schedule.name}, {total} optimizer steps, {ranks} rank{'s' if ranks != 1 else ''}"
        f" × accumulation {accumulation}"
    )
    plot(lrs, title, out)
    print(f"lr: first {format_lr(lrs[0])}, peak {format_lr(max(lrs))}, last {format_lr(lrs[-1])}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
