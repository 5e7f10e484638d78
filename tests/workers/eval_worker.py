"""Run under torchrun on 2 CPU ranks (gloo): TokenNormTrainer.evaluate() at several eval batch sizes; rank 0 writes
{eval batch size: [eval_loss, eval_label_tokens]} as JSON for tests/test_evaluation.py."""

import json
import sys

from finetune import TokenNormTrainer
from finetune.env import exit_process
from finetune.tools.toy import RecordingCollator, ragged_rows, sgd_args, tiny_llama


def main(out: str, trainer_dir: str) -> None:
    rows = ragged_rows(23, seed=9, min_len=4, max_len=48)  # as tests/test_evaluation.eval_rows()
    model, results = tiny_llama(), {}
    for batch in (1, 3, 7):
        trainer = TokenNormTrainer(
            model=model,
            args=sgd_args(trainer_dir, 1, 1, per_device_eval_batch_size=batch),
            eval_dataset=rows,
            data_collator=RecordingCollator(),
        )
        metrics = trainer.evaluate()
        results[batch] = [metrics["eval_loss"], metrics["eval_label_tokens"]]
    if trainer.args.process_index == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0)
