"""main() on 2 CPU ranks (gloo), forked by tests.launch.forked_ranks or run under torchrun: evaluate() at several
eval batch sizes; rank 0 writes {eval batch size: [eval_loss, eval_label_tokens(, generations equal to
Seq2SeqTrainer's)]} as JSON.

    eval_worker.py causal OUT TRAINER_DIR    TokenNormTrainer on a tiny Llama (tests/test_evaluation.py)
    eval_worker.py seq2seq OUT TRAINER_DIR   TokenNormSeq2SeqTrainer with predict_with_generate on a tiny T5
                                             (tests/test_seq2seq.py)
"""

import json
import sys

from transformers import Seq2SeqTrainer

from finetune import TokenNormSeq2SeqTrainer, TokenNormTrainer
from finetune.env import exit_process
from finetune.testing.toy import RecordingCollator, ragged_rows, sgd_args, tiny_llama
from tests.dropin_models import MetricInputs, PadEachCollator, generating_args, seq2seq_rows, tiny_t5


def causal(model, trainer_dir: str, batch: int):
    rows = ragged_rows(23, seed=9, min_len=4, max_len=48)  # as tests/test_evaluation.eval_rows()
    trainer = TokenNormTrainer(
        model=model,
        args=sgd_args(trainer_dir, 1, 1, per_device_eval_batch_size=batch),
        eval_dataset=rows,
        data_collator=RecordingCollator(),
    )
    metrics = trainer.evaluate()
    return trainer, [metrics["eval_loss"], metrics["eval_label_tokens"]]


def seq2seq(model, trainer_dir: str, batch: int):
    rows = seq2seq_rows(23, seed=9)
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
    return trainer, [metrics["eval_loss"], metrics["eval_label_tokens"], same]


KINDS = {"causal": (tiny_llama, causal), "seq2seq": (tiny_t5, seq2seq)}


def main(kind: str, out: str, trainer_dir: str) -> None:
    make_model, evaluate = KINDS[kind]
    model, results = make_model(), {}
    for batch in (1, 3, 7):
        trainer, results[batch] = evaluate(model, trainer_dir, batch)
    if trainer.args.process_index == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0)
