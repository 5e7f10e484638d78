"""finetune: exact, fast large-batch fine-tuning of Hugging Face Transformers models."""

from finetune.config import Config, RecipeError, load_config
from finetune.loss import count_label_tokens, token_loss_sum
from finetune.trainer import TokenNormTrainer

__all__ = ["Config", "RecipeError", "TokenNormTrainer", "count_label_tokens", "load_config", "token_loss_sum"]
