"""Record the golden trajectories: each shipped recipe (recipes/*.yaml) trained at debug size, in this process through
the public entry points (finetune.load_config, finetune.build), its loss, gradient norm (before clipping), learning
rate and target count per optimizer step written to tests/golden/<recipe>.json with the overrides that made it small,
the versions and the date. tests/test_golden.py re-runs each file's overrides and compares every step, so a change
that moves a number is seen.

    python scripts/record_golden.py              # every recipe
    python scripts/record_golden.py debug vlm    # these
    python scripts/record_golden.py --out DIR    # elsewhere (to measure the drift between two recordings)

Debug size: a few steps on a few rows with the recipe's own batching, optimizer, schedule, precision and loss. The
text recipes train recipes/debug.yaml's tiny random Llama (SmolLM2's config shrunk; model.from_config). The VLM
recipes cannot shrink their language model by a key (model.from_config is for text models), and with SmolLM2-135M
four steps train for about 35 s on 2 CPU cores; so they assemble their LLaVA (their own vision tower, projector,
freezing and LR multipliers) from that tiny Llama instead: `language_model` names the overrides of the text run
whose model, saved to a folder, becomes model.name_or_path (`{language_model}` in `overrides`). That LLaVA is
assembled into a cache of the run's own (FINETUNE_CACHE), so no run leaves one behind. Every run uses one torch
thread (THREADS).

Re-record only for a change meant to move these numbers, and say in the commit why they moved.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
TINY = [  # recipes/debug.yaml's model: SmolLM2's config shrunk, random init
    "model.from_config=true",
    "model.config_overrides.hidden_size=64",
    "model.config_overrides.intermediate_size=128",
    "model.config_overrides.num_hidden_layers=2",
    "model.config_overrides.num_attention_heads=4",
    "model.config_overrides.num_key_value_heads=2",
]
LANGUAGE_MODEL = "{language_model}"
TINY_LANGUAGE_MODEL = ["recipe=debug", *TINY]
ASSEMBLED = [f"model.name_or_path={LANGUAGE_MODEL}", "model.gguf_file=null"]
GOLDEN = {  # recipe → its debug-size run
    "bench": {
        "overrides": [
            "recipe=bench",
            *TINY,
            "data.limit=64",
            "train.micro_batch_size=2",  # accumulation 4, as the recipe's 8 × 4
            "train.global_batch_size=8",
        ]
    },
    "debug": {"overrides": ["recipe=debug"]},
    "quickstart": {
        "overrides": [
            "recipe=quickstart",
            *TINY,
            "data.limit=160",  # 8 of them held out (eval.fraction 0.05, whole stdlib modules)
            "train.micro_batch_size=4",  # accumulation 2, as the recipe's 8 × 2
            "train.global_batch_size=8",
            "train.max_steps=5",
        ]
    },
    "qlora": {  # the tiny Llama quantized to 4-bit NF4 (from_config: saved, then loaded quantized)
        "overrides": [
            "recipe=qlora",
            *TINY,
            "data.limit=160",
            "train.micro_batch_size=4",  # accumulation 2, as the recipe's 8 × 2
            "train.global_batch_size=8",
            "train.max_steps=5",
        ]
    },
    "vlm": {
        "language_model": TINY_LANGUAGE_MODEL,
        "overrides": ["recipe=vlm", *ASSEMBLED, "data.limit=64", "train.max_steps=5"],
    },
    "vlm_qwen": {  # packed: each sequence's mrope positions from the collator
        # Qwen2's language model has head_dim = hidden / heads (SmolLM2's config states 64 for 9 heads)
        "language_model": [*TINY_LANGUAGE_MODEL, "model.config_overrides.head_dim=16"],
        "overrides": ["recipe=vlm_qwen", *ASSEMBLED, "data.limit=64", "train.max_steps=5"],
    },
    "vlm_seed": {
        "language_model": TINY_LANGUAGE_MODEL,
        "overrides": [
            "recipe=vlm_seed",
            *ASSEMBLED,
            "data.limit=32",
            "train.micro_batch_size=8",  # accumulation 2 (the recipe's: 64)
            "train.global_batch_size=16",  # lr 1e-4 × 16 / 256 by the recipe's linear rule
            "train.epochs=2",  # 4 steps, the OneCycle schedule over both epochs
        ],
    },
}
RUN = ["log.wandb_mode=disabled", "train.save_steps=0"]  # every run: nothing reported, no checkpoint
ABOUT = (
    "written by scripts/record_golden.py: the recipe trained at debug size (`overrides`; `language_model`: the text "
    "run whose model becomes model.name_or_path) and each optimizer step's logged values; tests/test_golden.py "
    "re-runs it and compares every step"
)
THREADS = 1  # the same reduction order on any machine, and no thread waiting on another on a busy one (tiny models)
METRICS = ("loss", "grad_norm", "learning_rate", "window_label_tokens")


def step_recorder():
    """A TrainerCallback that keeps METRICS of each optimizer step's log entry (`.steps`)."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:  # a step's entry (the run's last one has train_loss instead)
                self.steps.append({"step": state.global_step, **{key: logs[key] for key in METRICS}})

    return StepRecorder()


def train(overrides: list[str], output_dir: Path) -> list[dict]:
    """Train `overrides` (evaluation off) and return each optimizer step's METRICS."""
    import finetune

    recorder = step_recorder()
    cfg = finetune.load_config([*overrides, *RUN, f"train.output_dir={output_dir}"])
    finetune.build(cfg, evaluate=False, callbacks=[recorder]).train()
    return recorder.steps


def save_language_model(overrides: list[str], folder: Path) -> Path:
    """The model (untrained) and tokenizer of the text run `overrides`, saved to `folder`."""
    import finetune

    cfg = finetune.load_config([*overrides, *RUN, f"train.output_dir={folder / 'run'}"])
    trainer = finetune.build(cfg, evaluate=False)
    trainer.model.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op threads set to `count` inside the block, as they were after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def cache_folder(folder: Path):
    """FINETUNE_CACHE set to `folder` inside the block, as it was after."""
    before = os.environ.get("FINETUNE_CACHE")
    os.environ["FINETUNE_CACHE"] = str(folder)
    try:
        yield
    finally:
        if before is None:
            del os.environ["FINETUNE_CACHE"]
        else:
            os.environ["FINETUNE_CACHE"] = before


def trajectory(entry: dict, workdir: Path) -> list[dict]:
    """The per-step METRICS of a golden entry's run ({"overrides": […], "language_model": […] or absent}) on THREADS
    torch threads, with scratch files in `workdir`."""
    with torch_threads(THREADS):
        if not entry.get("language_model"):
            return train(entry["overrides"], workdir / "run")
        folder = save_language_model(entry["language_model"], workdir / "language_model")
        overrides = [item.replace(LANGUAGE_MODEL, str(folder)) for item in entry["overrides"]]
        with cache_folder(workdir / "cache"):  # the LLaVA assembled from `folder` is keyed by its path: not kept
            return train(overrides, workdir / "run")


def record(name: str) -> dict:
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as scratch:
        steps = trajectory(GOLDEN[name], Path(scratch))
    return {
        "recipe": f"recipes/{name}.yaml",
        "about": ABOUT,
        **GOLDEN[name],
        "recorded": {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": THREADS,
        },
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help=f"of {', '.join(GOLDEN)} (default: all)")
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR, help=f"default {GOLDEN_DIR.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.recipes if name not in GOLDEN]:
        parser.error(f"no golden run for {', '.join(unknown)}; these have one: {', '.join(GOLDEN)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.recipes or GOLDEN:
        golden = record(name)
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(golden, indent=1) + "\n")
        print(f"wrote {path}: {len(golden['steps'])} steps, loss {golden['steps'][-1]['loss']:.6g} at the last")
    return 0


if __name__ == "__main__":
    sys.exit(main())
