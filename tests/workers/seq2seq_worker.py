"""Run under torchrun on 2 CPU ranks (gloo): TokenNormSeq2SeqTrainer.evaluate() with predict_with_generate at several
eval batch sizes; rank 0 writes {eval batch size: [eval_loss, eval_label_tokens, generations equal to
Seq2SeqTrainer's]} as JSON for tests/test_seq2seq.py."""

import json
import sys

from transformers import Seq2SeqTrainer

from finetune import TokenNormSeq2SeqTrainer
from finetune.env import exit_process
from tests.dropin_models import PadEachCollator, seq2seq_rows, tiny_t5
from tests.test_seq2seq import MetricInputs, generating_args


def main(out: str, trainer_dir: str) -> None:
    rows = seq2seq_rows(23, seed=9)
    model, results = tiny_t5(), {}
    for batch in (1, 3, 7):
        seen, stock_seen = MetricInputs(), MetricInputs()
        trainer = TokenNormSeq2SeqTrainer(
            model=model,
            args=generating_args(trainer_dir, batch),
            eval_dataset=rows,
            data_collator=PadEachCollator(),
            compute_metrics=seen,
        )
        metrics = trainer.evaluate()
        Seq2SeqTrainer(
            model=model,
            args=generating_args(trainer_dir, batch),
            eval_dataset=rows,
            data_collator=PadEachCollator(),
            compute_metrics=stock_seen,
        ).evaluate()
        same = bool((seen.seen[0][0] == stock_seen.seen[0][0]).all())
        results[batch] = [metrics["eval_loss"], metrics["eval_label_tokens"], same]
    if trainer.args.process_index == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0)
