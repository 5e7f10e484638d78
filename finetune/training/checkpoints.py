"""Checkpoints that are complete or absent, and what resuming needs (lifecycle.py: a run's start and end).

A checkpoint-N (`save_atomically`, used by `RecipeTrainer._save_checkpoint`) holds the weights (model.safetensors, or
adapter_model.safetensors), optimizer.pt, scheduler.pt, scaler.pt (fp16), rng_state[_RANK].pth (Python, NumPy, torch,
CUDA), trainer_state.json (global step, log history), checkpoint_files.json (each file's size, checked at resume:
checkpoint_files.py) and finetune_state.json (our counters and the data position, resume_checks.py; last). Every
.pt/.pth loads with `torch.load(weights_only=True)`; the Trainer's training_args.bin (a pickle) is never loaded."""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Callable

import numpy as np
import torch

from finetune.model.files import commit
from finetune.recipe import RecipeError, TrainConfig, first_line
from finetune.training import checkpoint_files
from finetune.training.staging import STAGING, removed_when_empty, save_staged

STATE_FILE = "finetune_state.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


# ---- complete or absent ----


def staging_root(output_dir: str) -> str:
    return os.path.join(output_dir, STAGING)


def is_complete(path: str) -> bool:
    """Written by `save_atomically`: our state file is the last file written before the rename."""
    return os.path.isfile(os.path.join(path, STATE_FILE)) and os.path.isfile(os.path.join(path, "trainer_state.json"))


def checkpoints_in(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoint-N folders in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path) and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def resume_path(train: TrainConfig) -> str | None:
    """The checkpoint train.resume_from names: auto = the newest complete one in train.output_dir (None: fresh)."""
    resume = train.resume_from
    if resume is None:
        return None
    if resume == "auto":  # the newest one whose files are whole (an older one, with a warning)
        return checkpoint_files.newest_whole(checkpoints_in(train.output_dir), train.output_dir)
    if not os.path.isdir(resume):
        raise RecipeError(f"train.resume_from={resume}: no such checkpoint folder; give a checkpoint-N folder or auto")
    if not is_complete(resume):
        raise RecipeError(
            f"train.resume_from={resume}: not a complete checkpoint (no {STATE_FILE} or "
            "trainer_state.json); give a checkpoint-N folder written by finetune, or auto"
        )
    checkpoint_files.check_whole(resume)  # every damaged file named, before anything loads
    return resume


def checkpoint_step(folder: str) -> int:
    with open(os.path.join(folder, "trainer_state.json")) as f:
        return int(json.load(f).get("global_step", 0))


def write_state(folder: str, state: dict) -> None:
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump(state, f, indent=1)


def read_state(folder: str) -> dict:
    with open(os.path.join(folder, STATE_FILE)) as f:
        return json.load(f)


# ---- the same model ----


def _saved_shapes(checkpoint: str) -> tuple[str, dict[str, tuple]] | None:
    """(weights file, {name: shape}) from the safetensors headers; None for formats without one (FSDP, DeepSpeed)."""
    from safetensors import safe_open

    for base in ("adapter_model", "model"):
        single = os.path.join(checkpoint, f"{base}.safetensors")
        index = os.path.join(checkpoint, f"{base}.safetensors.index.json")
        if os.path.isfile(single):
            files = [single]
        elif os.path.isfile(index):
            with open(index) as f:
                files = sorted({os.path.join(checkpoint, v) for v in json.load(f)["weight_map"].values()})
        else:
            continue
        shapes = {}
        for file in files:
            with safe_open(file, framework="pt") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        return single if len(files) == 1 else index, shapes
    return None


def _model_shapes(model: torch.nn.Module, adapter: bool) -> tuple[dict[str, tuple], dict[str, set[str]]]:
    """({name: whole shape (ZeRO-3: ds_shape)}, {name: names sharing its storage}): a tied weight is saved once."""
    if adapter:
        from peft import get_peft_model_state_dict

        return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}, {}
    state = model.state_dict()
    groups: dict[int, set[str]] = {}  # tied names share one Parameter; ZeRO-3 partitions leave no storage to compare
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), set()).add(name)
    whole = {name: tuple(p.ds_shape) for name, p in model.named_parameters() if hasattr(p, "ds_shape")}
    return {k: whole.get(k, tuple(v.shape)) for k, v in state.items()}, {n: g for g in groups.values() for n in g}


def tied_missing(model: torch.nn.Module, missing: list[str]) -> list[str]:
    """`missing` without tied names (lm_head.weight = embed_tokens.weight is saved once, loaded through either)."""
    _, aliases = _model_shapes(model, adapter=False)
    return [k for k in missing if not (aliases.get(k, {k}) - set(missing))]


def check_same_model(checkpoint: str, model: torch.nn.Module) -> None:
    """One clear error when a checkpoint's weights do not fit this model (another architecture, size or LoRA set-up)."""
    saved = _saved_shapes(checkpoint)
    if saved is None:
        return
    file, shapes = saved
    adapter = os.path.basename(file).startswith("adapter_model")
    if adapter != hasattr(model, "peft_config"):
        kind = "LoRA adapter" if adapter else "full model"
        raise RecipeError(
            f"train.resume_from: {checkpoint} holds a {kind} checkpoint but this recipe trains "
            f"{'a full model' if adapter else 'a LoRA adapter'}; set model.lora.enabled as when it was written, or "
            "start fresh in another train.output_dir"
        )
    expected, aliases = _model_shapes(model, adapter)
    wrong = [k for k in shapes if k in expected and shapes[k] != expected[k]]
    extra = [k for k in shapes if k not in expected]
    missing = [k for k in expected if not (aliases.get(k, {k}) & shapes.keys())]
    if not (wrong or extra or missing):
        return
    if wrong:
        k = wrong[0]
        what = f"{k} has shape {list(shapes[k])} there but {list(expected[k])} in this model"
    elif extra:
        what = f"{len(extra)} tensors there are not in this model (e.g. {extra[0]})"
    else:
        what = f"{len(missing)} tensors of this model are not there (e.g. {missing[0]})"
    raise RecipeError(
        f"train.resume_from: {file} is from a different model ({what}); resume with the recipe that wrote it, or "
        "start fresh in another train.output_dir"
    )


# ---- random number generators, without pickled objects ----


def rng_state() -> dict:
    """Python, NumPy, torch and CUDA generator states as tensors, ints and tuples: loads with weights_only=True."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def load_rng_state(file: str) -> None:
    set_rng_state(torch.load(file, weights_only=True))


# ---- the Trainer's checkpoint hooks ----


def save_atomically(trainer, write: Callable[[str], None], files: dict[str, str]) -> None:
    """`write(root)`, the Trainer's own checkpoint save into `root` (RecipeTrainer.save_checkpoint_into), with
    output_dir/.staging as root; once every rank has written its part, rank 0 adds `files` ({file name: text}: the
    run's recipe.yaml, timings.jsonl), renames it into place, then rotates.

    transformers writes checkpoint-N in place, file after file: a kill mid-save would leave a folder that looks like a
    checkpoint and would be resumed from (staging.py: the same skeleton as the best model and the final set).
    """
    from transformers.trainer_utils import rotate_checkpoints

    run_dir = trainer.args.output_dir
    name = f"checkpoint-{trainer.state.global_step}"

    def finish(staged: str) -> None:
        for file_name, text in files.items():
            with open(os.path.join(staged, file_name), "w") as f:
                f.write(text)
        checkpoint_files.record_sizes(staged)  # what resume checks each file against
        write_state(staged, trainer.checkpoint_state())  # last: it marks the folder complete
        commit(staged, os.path.join(run_dir, name))
        rotate_checkpoints(run_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint)

    with removed_when_empty(staging_root(run_dir), trainer.args.should_save) as root:
        save_staged(trainer, os.path.join(root, name), name, lambda staged: write(root), finish)


def rng_file(world_size: int, process_index: int) -> str:
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{process_index}.pth"


def restore_rng_state(checkpoint: str, file_name: str) -> None:
    file = os.path.join(checkpoint, file_name)
    if not os.path.isfile(file):
        print(
            f"warning: {file} not found: random number generators are not restored (a checkpoint written with "
            "another number of ranks?)",
            file=sys.stderr,
        )
        return
    try:
        load_rng_state(file)
    except (RuntimeError, ValueError, KeyError, EOFError) as e:  # a damaged file, which the size check missed
        raise RecipeError(
            f"train.resume_from: {checkpoint}/{file_name} cannot be read ({first_line(e)}); resume "
            "from an earlier checkpoint-N"
        ) from None


def optimizer_state_error(checkpoint: str, error: Exception) -> RecipeError:
    """What the Trainer's failure to load optimizer.pt or scheduler.pt means: a damaged file, or another recipe."""
    why = first_line(error)
    if "zip archive" in why or "PytorchStreamReader" in why:  # the file itself, not the recipe
        return RecipeError(
            f"train.resume_from: {checkpoint}: optimizer.pt or scheduler.pt cannot be read "
            f"({why}); resume from an earlier checkpoint-N"
        )
    return RecipeError(
        f"train.resume_from: the optimizer state in {checkpoint} does not fit this run ({why}); resume with "
        "the recipe that wrote it (optim.name, model.freeze, model.lora), or start fresh in another "
        "train.output_dir"
    )


def epoch_seeded(sampler, seed: int):
    """transformers' LengthGroupedSampler draws its order from the global torch generator, whose state at the start of
    an epoch a resumed run cannot reproduce; this one draws it from train.seed and the epoch."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
        def set_epoch(self, epoch: int) -> None:  # the Trainer calls it (through accelerate) before each epoch
            self.generator = torch.Generator().manual_seed(seed + epoch)

    if type(sampler) is not LengthGroupedSampler:
        return sampler
    seeded = EpochSeededLengthGroupedSampler(sampler.batch_size, lengths=sampler.lengths)
    seeded.set_epoch(0)
    return seeded
