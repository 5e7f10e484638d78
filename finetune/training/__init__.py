"""A recipe's whole run around the trainer: everything `finetune.assemble.build` hands the Trainer besides the model
and the data.

Owns the recipe's optimizers (AdamW, SGD, LAMB, LARS) and LR schedules, checkpoints that are complete or absent and
resume bitwise, a run's start and end (output folder checks, signals, the final save), what `accelerate launch`
decided checked against the recipe, what a run shows (W&B, the console, timings.jsonl, the profiler), evaluation
during a run (when, what is logged, the best model, early stopping), generated samples, and `RecipeTrainer`
(recipe_trainer.py: TokenNormTrainer plus all of the above). May import `finetune.core.trainer` (the drop-in),
`finetune.recipe`, `finetune.env`, `finetune.core.meter` (the measured keys), `finetune.model` (the module-name prefix
rule; files checked and written whole) and torch/transformers/accelerate; never `finetune.assemble` or
`finetune.tools`.
"""
