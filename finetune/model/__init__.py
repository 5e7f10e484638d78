"""The model side: from the recipe's `model:` section to the module the Trainer trains.

Owns loading (a hub id, a local folder, `pkg:PACKAGE`, a GGUF converted once into a plain folder in the cache:
`loading`; a folder's files checked whole first: `files`, also used for checkpoints), what trains (`freeze`:
model.freeze and LoRA), vision-language models (`vlm`: loading, checks, the tower on every micro-batch, LoRA on the
language model only; `image_rows`: what its forward takes beside the rows and whether they pack; `llava`: a LLaVA
assembled once from a text model; `qwen_vl`: a Qwen2.5-VL likewise; `assemblies`: which one model.vision_config asks
for; `processors`: Qwen-VL processors image-only without torchvision) and packed attention (`packed_attention`:
causal sdpa per sequence of a packed row; `varlen_attention`: one varlen kernel call per layer on CUDA). May import
`finetune.recipe`, `finetune.env` and the model libraries (torch, transformers, peft); never the data, training or
tools packages.
"""
