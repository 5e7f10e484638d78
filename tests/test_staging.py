"""The one staged save (finetune/training/staging.py) as the best model uses it, in-process on one rank: the folder
lands whole (an older one replaced), a failed write is one line and leaves nothing behind, and an interrupt leaves no
staged folder either. The checkpoint and final-set paths run the same code under real faults in test_faults.py and
test_bad_input.py."""

import errno
import json
import os
from types import SimpleNamespace

import pytest

from finetune.recipe import RecipeError
from finetune.training import best_model, staging
from finetune.training.checkpoints import STAGING


@pytest.fixture
def accelerate_state():
    """save_best asks accelerate whether FSDP runs (distributed.full_state_dict): a plain CPU state, reset after."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    Accelerator(cpu=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def best_trainer(output_dir, save_model, step=3, metric=0.5):
    return SimpleNamespace(
        args=SimpleNamespace(output_dir=str(output_dir), should_save=True),
        accelerator=SimpleNamespace(wait_for_everyone=lambda: None),  # one rank
        state=SimpleNamespace(global_step=step, best_metric=metric),
        save_model=save_model,
        merge_lora=False,  # no model.lora.merge: the saved model as it is
    )


def write_weights(text):
    def save_model(folder):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "w") as f:
            f.write(text)

    return save_model


def test_the_best_model_lands_whole_and_replaces_the_older_one(tmp_path, accelerate_state):
    best_model.save_best(best_trainer(tmp_path, write_weights("first"), step=2, metric=0.7))
    (tmp_path / "best" / "stale.txt").write_text("of the first best")
    best_model.save_best(best_trainer(tmp_path, write_weights("second"), step=5, metric=0.4))
    best = tmp_path / "best"
    assert sorted(p.name for p in best.iterdir()) == ["best.json", "model.safetensors"]
    assert (best / "model.safetensors").read_text() == "second"
    assert json.loads((best / "best.json").read_text()) == {"step": 5, "eval_loss": 0.4}
    assert not (tmp_path / STAGING).exists()


def test_a_full_disk_while_the_best_model_is_written_is_one_line_and_leaves_nothing(tmp_path, accelerate_state):
    def full_disk(folder):
        write_weights("part")(folder)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(RecipeError) as raised:
        best_model.save_best(best_trainer(tmp_path, full_disk))
    assert str(raised.value) == (
        f"train.output_dir={tmp_path}: writing the best model failed (No space left on device); the disk is full; "
        "free space there or choose another train.output_dir, then resume (nothing half-written was left there)"
    )
    assert sorted(os.listdir(tmp_path)) == []


def test_an_interrupt_mid_save_is_raised_as_it_is_and_removes_the_staged_folder(tmp_path):
    staged = tmp_path / ".staged"

    def interrupted(folder):
        write_weights("part")(folder)
        raise KeyboardInterrupt

    finished = []
    with pytest.raises(KeyboardInterrupt):
        staging.save_staged(best_trainer(tmp_path, None), str(staged), "x", interrupted, finished.append)
    assert not staged.exists() and finished == []


def test_only_rank_0_finishes_and_clears_what_a_killed_save_left(tmp_path):
    staged = tmp_path / ".staged"
    staged.mkdir()
    (staged / "left.txt").write_text("by a killed save")
    other = best_trainer(tmp_path, None)
    other.args.should_save = False  # not rank 0: writes its part only
    finished = []
    staging.save_staged(other, str(staged), "x", write_weights("shard"), finished.append)
    assert finished == [] and (staged / "left.txt").exists()
    staging.save_staged(best_trainer(tmp_path, None), str(staged), "x", write_weights("whole"), finished.append)
    assert finished == [str(staged)] and sorted(os.listdir(staged)) == ["model.safetensors"]
