"""The best model (`eval.best_checkpoint`): a new lowest eval loss writes the model into `train.output_dir/best`
(staged, then renamed into place: whole or absent), with best.json naming its step and loss."""

from __future__ import annotations

import json
import os

from tqdm.auto import tqdm

from finetune.evaluation.metrics import BEST
from finetune.model import lora_merge
from finetune.model.files import commit
from finetune.training import distributed
from finetune.training.checkpoints import staging_root
from finetune.training.staging import removed_when_empty, save_staged

BEST_FILE = "best.json"


def save_best(trainer) -> None:
    """The model (and tokenizer or processor) into output_dir/best: staged, then renamed into place."""
    run_dir = trainer.args.output_dir
    final = os.path.join(run_dir, BEST)

    def write(staged: str) -> None:
        with distributed.full_state_dict():  # FSDP's sharded checkpoints would write no weights here
            trainer.save_model(staged)  # every rank: FSDP/ZeRO-3 gather the weights
            if trainer.merge_lora:  # model.lora.merge: the merged model, the adapter in adapter/
                lora_merge.write_merged(trainer, staged)

    def finish(staged: str) -> None:
        with open(os.path.join(staged, BEST_FILE), "w") as f:
            json.dump({"step": trainer.state.global_step, "eval_loss": trainer.state.best_metric}, f)
        commit(staged, final)
        tqdm.write(f"best eval loss so far ({trainer.state.best_metric:.4f}): model saved to {final}")

    with removed_when_empty(staging_root(run_dir), trainer.args.should_save) as root:
        save_staged(trainer, os.path.join(root, BEST), "the best model", write, finish)
