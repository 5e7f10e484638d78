"""finetune: exact, fast large-batch fine-tuning of Hugging Face Transformers models."""

from finetune.recipe import Config, RecipeError, load_config

# Lazy: `finetune/train.py` checks a recipe before torch and transformers are imported, so a typo fails at once.
_LAZY = {
    "TokenNormTrainer": "finetune.core.trainer",
    "TokenNormSeq2SeqTrainer": "finetune.core.seq2seq_trainer",
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
