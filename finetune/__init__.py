"""finetune: exact, fast large-batch fine-tuning of Hugging Face Transformers models."""

import logging

from finetune.recipe import Config, RecipeError, load_config

# bitsandbytes' CPU backend logs at import, on a CPU with AVX-512 BF16, that it could not load a hub kernel for its
# packed 4-bit inference layout; peft imports bitsandbytes for any LoRA model, so every run would print it. No run
# here uses that layout (finetune/model/quantized.py keeps 4-bit weights as training reads them): the line is not
# true of this process. Set before anything can import bitsandbytes; its other lines pass.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")
)

# Lazy: `finetune/train.py` checks a recipe before torch and transformers are imported, so a typo fails at once.
_LAZY = {
    "TokenNormTrainer": "finetune.core.trainer",
    "TokenNormSeq2SeqTrainer": "finetune.core.seq2seq_trainer",
    "TokenNormGRPOTrainer": "finetune.rl.grpo_trainer",
    "build": "finetune.assemble",
    "count_label_tokens": "finetune.core.loss",
    "token_loss_sum": "finetune.core.loss",
}

__all__ = ["Config", "RecipeError", "load_config", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")
