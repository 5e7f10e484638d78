"""The drop-in: `TokenNormTrainer` and `TokenNormSeq2SeqTrainer` (transformers.Trainer and Seq2SeqTrainer
subclasses), the loss heads, the summed token losses and their counts, the window's token mean, the step verdict and
the throughput meter. Every optimizer step divides the window's summed loss by its label tokens over all
data-parallel ranks.

It imports torch, transformers, accelerate and peft, and nothing of finetune outside this package: the recipe runner
(recipe, data, model, training, tools) is built on it, never the reverse, so a research repository can take the
trainer alone.
"""
