"""Evaluation in one place: the eval sets (`sets`: rows held out of data.source or read from eval.source and
eval.sets, checked against the training rows, their micro-batches), the named sets evaluated as one pass
(`named_sets`), what is logged per evaluation and when, early stopping and the end-of-run figures (`metrics`), the
prompts samples are generated from (`prompts`) and the generation itself (`samples`). The exact eval loss is the
drop-in's (finetune/core/token_mean.py); the best model's save is training's (finetune/training/best_model.py).

May import `finetune.core`, `finetune.data`, `finetune.recipe`, `finetune.env` and torch/transformers; never the
model, training or tools packages (training imports this package, not the reverse).
"""
