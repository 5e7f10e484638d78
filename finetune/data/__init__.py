"""The data side: from the recipe's `data:` section to the micro-batches the Trainer samples.

Owns where rows come from (`sources`: files, folders, hub ids, the counts of a load), which format rows have and the
mapping keys that read them (`formats`: ShareGPT, Alpaca, data.columns/roles/message_keys), text rows and their chat
labels (`text`), image+text rows and their collator (`vision`) and image files (`images`), rows streamed as training
goes (`streaming`), how rows become micro-batches for each `data.batching` mode (`batching`), the built-in sets
(`stdlib_docs`, `shapes_captions`), the eval set (`heldout`: rows held out of data.source or read from eval.source,
its micro-batches) and the prompts samples are generated from (`prompts`). May import `finetune.recipe`,
`finetune.env`, `finetune.core.labels` and the data libraries (datasets, transformers' tokenizers and
collators, PIL, torch's Dataset); never the model, training or tools packages.
"""
