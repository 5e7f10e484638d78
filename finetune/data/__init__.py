"""The data side: from the recipe's `data:` section to the micro-batches the Trainer samples.

Owns where rows come from (`sources`: files, folders, hub ids, the counts of a load), which format rows have and the
mapping keys that read them (`formats`: ShareGPT, Alpaca, data.columns/roles/message_keys), text rows and their chat
labels (`text`), image+text rows and their collator (`vision`; `image_inputs`: the token types and packed rope
positions a VLM's forward takes) and image files (`images`), text or image+text rows as one kind (`row_kinds`), rows
streamed as training goes (`streaming`), how rows become micro-batches for each `data.batching` mode (`batching`),
the built-in sets (`stdlib_docs`, `shapes_captions`), the training set less its held-out rows (`training_set`) and
data.mixture (`mixture`). The eval sets built from held-out rows live in finetune/evaluation. May import
`finetune.recipe`, `finetune.env`, `finetune.core` and the data libraries (datasets, transformers' tokenizers and
collators, PIL, torch's Dataset); never the model, evaluation, training or tools packages.
"""
