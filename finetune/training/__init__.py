"""A recipe's whole run around the trainer: everything `finetune.assemble.build` hands the Trainer besides the model
and the data.

Owns the recipe's optimizers (AdamW, SGD, LAMB, LARS) and LR schedules, checkpoints that are complete or absent and
resume bitwise, a run's start and end (output folder checks, signals, the final save), what `accelerate launch`
decided checked against the recipe, what a run shows (W&B, the console, timings.jsonl, the profiler), the best
model's save, and `RecipeTrainer` (recipe_trainer.py: TokenNormTrainer plus all of the above, evaluating through
finetune/evaluation). May import `finetune.core` (the drop-in), `finetune.evaluation`, `finetune.recipe`,
`finetune.env`, `finetune.model` (the module-name prefix rule; files checked and written whole) and
torch/transformers/accelerate; never `finetune.data`, `finetune.assemble` or `finetune.tools`.
"""
