"""What a checkpoint records about the run that wrote it, and what a resume compares with it: the data position and
the recipe (KEY_RULES: per key, free, refused, or applied to the optimizer and scheduler with one warning).

A checkpoint is only taken between optimizer steps, so its data position is global_step × accumulation micro-batches
into the epoch (the Trainer skips them at resume); that is the same place only when the recorded figures agree.
A stream (data.streaming) has no length: one endless pass (finetune/data/streaming.py), whose position is the same
count of micro-batches from its start.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import weakref

import numpy as np
import yaml
from omegaconf import OmegaConf
from transformers import TrainerCallback
from transformers.trainer_utils import has_length

from finetune.recipe import OPEN_DICTS, Config, RecipeError
from finetune.recipe.run_plan import peak_lr

STREAM = "stream"  # dataset_items of a streamed run

# What each entry of a checkpoint's data position comes from, in recipe keys
DATA_POSITION_KEYS = {
    "dataset_items": "data.source/data.limit",
    "seed": "train.seed",
    "ranks": "the number of ranks",
    "micro_batches_per_step": "train.global_batch_size (or global_batch_tokens)",
    "items_per_micro_batch": "train.micro_batch_size",
    "data_fingerprint": "data.source (its rows as read differ: the file was rewritten, or another one named)",
}
STREAM_FINGERPRINT_ROWS = 1024  # a stream's fingerprint: its first rows in the source's order
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a memo: a dataset's rows never change


def _array_digest(column) -> tuple[bytes, bytes]:
    """(digest of the flattened values, digest of the row lengths) of an arrow list column, chunk by chunk (no copy
    of the whole column; the same digests however it is chunked)."""
    import pyarrow.compute as pc

    values, lengths = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
    for chunk in column.chunks:  # as int32 (token ids and -100 fit): half the bytes to hash
        values.update(np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype="<i4").data)
        lengths.update(np.asarray(pc.list_value_length(chunk).to_numpy(zero_copy_only=False), dtype="<i4").data)
    return values.digest(), lengths.digest()


def _rows_digest(rows) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for row in rows:
        for key in ("input_ids", "labels"):
            ids = np.asarray(row[key], dtype="<i8")
            digest.update(len(ids).to_bytes(8, "little") + ids.tobytes())
    return digest.digest()


def data_fingerprint(dataset) -> str | None:
    """A hash of the training rows as read (token ids and labels): every row of an in-memory set (its arrow columns,
    chunk by chunk), a stream's first STREAM_FINGERPRINT_ROWS; None for a dataset of another kind."""
    if dataset in _fingerprints:
        return _fingerprints[dataset]
    digest = hashlib.blake2b(digest_size=8)
    if (
        hasattr(dataset, "data")
        and hasattr(dataset, "column_names")
        and {"input_ids", "labels"} <= set(dataset.column_names)
    ):
        table = dataset.flatten_indices().data if getattr(dataset, "_indices", None) is not None else dataset.data
        for name in ("input_ids", "labels"):
            digest.update(b"".join(_array_digest(table.column(name))))
    elif hasattr(dataset, "rows") and hasattr(dataset, "groups"):  # budgeted micro-batches: their rows
        digest.update(_rows_digest(dataset.rows))
    elif hasattr(dataset, "rows") and not has_length(dataset):  # a stream
        digest.update(_rows_digest(itertools.islice(dataset.rows(), STREAM_FINGERPRINT_ROWS)))
    else:
        return None
    _fingerprints[dataset] = digest.hexdigest()
    return _fingerprints[dataset]


def data_position(trainer) -> dict:
    """The figures that fix where in the data global_step × accumulation micro-batches lead."""
    dataset = trainer.train_dataset
    args = trainer.args
    return {
        "dataset_items": len(dataset) if has_length(dataset) else STREAM,
        "seed": args.seed,
        "ranks": args.world_size,
        "micro_batches_per_step": args.gradient_accumulation_steps,
        "items_per_micro_batch": args.per_device_train_batch_size,
        "data_fingerprint": data_fingerprint(dataset),
    }


def _differ(saved: dict, now: dict) -> list[str]:
    keys = [k for k in now if k in saved and saved[k] is not None and now[k] is not None and saved[k] != now[k]]
    return [k for k in keys if k != "data_fingerprint" or keys == [k]]  # other rows matter when nothing else differs


def position_changes(saved: dict, now: dict) -> list[str]:
    """`key old → new` for each recorded figure that differs."""
    return [f"{k} {saved[k]} → {now[k]}" for k in _differ(saved, now)]


def changed_keys(saved: dict, now: dict) -> str:
    return ", ".join(DATA_POSITION_KEYS[k] for k in _differ(saved, now))


# ---- the recipe that trained, in each checkpoint; compared at resume ----

RECIPE = "recipe.yaml"
HISTORY = "# resumed at optimizer step "  # recipe.yaml's first lines: what changed at each resume

# How a key that differs from the checkpoint's recipe is treated (the first matching prefix decides):
# free: changes nothing of the training maths; position: the data position check names it (finetune_state.json);
# data: other rows, refused unless train.resume_data_order_change=allow; applied: the optimizer and scheduler take
# the new value from the next step, with one warning; anything else (model, optimizer, precision) is refused.
KEY_RULES = (
    (
        "free",
        (
            "recipe",
            "train.output_dir",
            "train.resume_from",
            "train.save_steps",
            "train.save_total_limit",
            "train.resume_data_order_change",
            "train.on_nonfinite",
            "train.profile_steps",
            "train.gradient_checkpointing",
            "train.activation_offloading",
            "train.sync_each_batch",
            "train.compile_layers",
            "log.",
            "eval.",
            "data.num_workers",
            "model.attn_implementation",
            "model.trust_remote_code",
            "model.liger_kernels",
        ),
    ),
    (
        "position",
        (
            "train.seed",
            "train.micro_batch_size",
            "train.global_batch_size",
            "train.global_batch_tokens",
            "data.source",
            "data.limit",
        ),
    ),
    ("data", ("data.",)),
    (
        "applied",
        (
            "optim.lr",
            "optim.lr_scaling",
            "optim.base_batch_size",
            "schedule.",
            "train.max_steps",
            "train.epochs",
            "train.max_grad_norm",
        ),
    ),
)


def key_rule(key: str) -> str:
    for rule, prefixes in KEY_RULES:
        if any(key == p or (p.endswith(".") and key.startswith(p)) or key.startswith(p + ".") for p in prefixes):
            return rule
    return "refused"


def flat(tree: dict, prefix: str = "") -> dict:
    """{"optim.lr": 1e-3, …}; open maps (model.config_overrides, optim.lr_multipliers) stay one value each."""
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in OPEN_DICTS and value:
            out.update(flat(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def config_of(tree: dict) -> Config:
    """A recorded recipe as a Config (no checks: it trained)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), tree))


class RecipeRecord(TrainerCallback):
    """The recipe that trained: recipe.yaml in every checkpoint (checkpoints.save_atomically writes what
    `files_for_checkpoint` gives) and in the final save, its first lines naming what each resume changed. `resume`
    compares a checkpoint's recipe with this run's: a refused key is one RecipeError naming it and both values; an
    applied one (lr, schedule, run length, clipping) is stated in one warning and, at train begin, put into the
    optimizer and scheduler the checkpoint restored. `recipe`: this run's recipe as recipe.yaml holds it
    (finetune.recipe.to_yaml), read back the way a checkpoint's is."""

    def __init__(self, recipe: str):
        self.recipe = recipe
        self.cfg = config_of(yaml.safe_load(recipe) or {})
        self.history: list[str] = []
        self.lr_ratio: float | None = None  # the new peak lr over the recorded one, once resumed with changes

    def text(self) -> str:
        return "".join(self.history) + self.recipe

    def files_for_checkpoint(self) -> dict[str, str]:
        return {RECIPE: self.text()}

    def resume(self, checkpoint: str, step: int) -> str | None:
        """Check `checkpoint`'s recorded recipe against this run's; the warning to print, or None."""
        path = os.path.join(checkpoint, RECIPE)
        if not os.path.isfile(path):
            return None  # written by an older version: nothing recorded to compare
        with open(path) as f:
            text = f.read()
        self.history = [line + "\n" for line in text.splitlines() if line.startswith(HISTORY)]
        saved_cfg = config_of(yaml.safe_load(text) or {})
        saved = flat(OmegaConf.to_container(OmegaConf.structured(saved_cfg)))
        now = flat(OmegaConf.to_container(OmegaConf.structured(self.cfg)))
        by_rule: dict[str, list[tuple]] = {}
        for key in (k for k in now if k in saved and saved[k] != now[k]):
            by_rule.setdefault(key_rule(key), []).append((key, saved[key], now[key]))
        if by_rule.get("refused"):
            (key, old, new), more = by_rule["refused"][0], len(by_rule["refused"]) - 1
            others = f" (and {more} other keys)" if more else ""
            raise RecipeError(
                f"train.resume_from: {checkpoint} was trained with {key}={old}, this run has {key}={new}"
                f"{others}; resume with the recipe that wrote it, or start fresh in another "
                "train.output_dir"
            )
        if by_rule.get("data") and self.cfg.train.resume_data_order_change != "allow":
            key, old, new = by_rule["data"][0]
            raise RecipeError(
                f"train.resume_from: {checkpoint} was trained with {key}={old}, this run has {key}={new} "
                "(other rows); set it as that run had it, or set train.resume_data_order_change=allow"
            )
        applied = by_rule.get("applied", [])
        cycle = [a for a in applied if not a[0].startswith("train.max_grad_norm")]
        if cycle and "onecycle" in (saved_cfg.schedule.name, self.cfg.schedule.name):
            raise RecipeError(
                f"train.resume_from: resuming with {cycle[0][0]}={cycle[0][2]} (was {cycle[0][1]})"
                " under schedule.name=onecycle, whose cycle the checkpoint holds; resume with the recipe "
                "that wrote it"
            )
        changed = [f"{key} {old} → {new}" for key, old, new in applied + by_rule.get("data", [])]
        if not changed:
            return None
        self.lr_ratio = peak_lr(self.cfg) / peak_lr(saved_cfg)
        self.history.append(f"{HISTORY}{step}: {', '.join(changed)}\n")
        return (
            f"warning: resuming with {', '.join(changed)}: applied from optimizer step {step + 1} (the "
            f"optimizer and scheduler take them; steps 1-{step} trained with the recorded values, and recipe.yaml "
            "says so)"
        )

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if self.lr_ratio is None or not hasattr(lr_scheduler, "lr_lambdas") or optimizer is None:
            return  # OneCycleLR: refused at resume
        # The checkpoint restored the optimizer's lr and the scheduler's base_lrs as they were; the schedule's shape
        # (LambdaLR's function) is this run's. Scale the peak, then set each group's lr for the next step.
        lr_scheduler.base_lrs = [base * self.lr_ratio for base in lr_scheduler.base_lrs]
        step = lr_scheduler.last_epoch
        for group, base, factor in zip(optimizer.param_groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * factor(step)
        lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        self.lr_ratio = None
