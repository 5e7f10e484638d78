"""Run under torchrun: packed Qwen2.5-VL rows (tests/test_vlm_mrope_packed.py) trained on 2 CPU ranks (gloo), 3 rows
per packed micro-batch on each rank, one optimizer step over all six rows; rank 0 saves the parameters.

    torchrun --nproc_per_node 2 tests/workers/mrope_worker.py OUT
"""

import sys
from types import SimpleNamespace

import datasets
import torch

from finetune import TokenNormTrainer
from finetune.data.batching import row_collator
from finetune.data.image_inputs import ImageInputs
from finetune.data.vision import VisionCollator
from finetune.env import exit_process
from finetune.model.image_rows import forward_inputs
from finetune.model.packed_attention import use_for_packed_rows
from finetune.recipe import Batching
from finetune.testing.toy import SnapshotCallback, sgd_args
from tests.mrope_models import ROWS, image_processor, tiny


def main(out: str) -> None:
    model = tiny("qwen2_5_vl")
    assert use_for_packed_rows(model, "data.batching=padded").startswith("attention: packed_sdpa")
    processor = SimpleNamespace(image_processor=image_processor())
    collator = VisionCollator(
        row_collator(Batching("packed", 1, None), None), processor, ImageInputs(**forward_inputs(model.config))
    )
    snapshots = SnapshotCallback()
    trainer = TokenNormTrainer(
        model=model, args=sgd_args(out + ".trainer", 3, 1, max_steps=1), train_dataset=datasets.Dataset.from_list(ROWS),
        data_collator=collator, callbacks=[snapshots],
    )  # fmt: skip
    trainer.train()
    if trainer.args.process_index == 0:
        torch.save({"snapshots": snapshots.snapshots}, out)
    torch.distributed.barrier()  # leave together (see tests/workers/dist_worker.py)
    # no destroy_process_group: freeing the group right after a gloo collective can deadlock (finetune.env.exit_process)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0)  # no object teardown: see finetune.env.exit_process
