"""Old name of `finetune.recipe`, kept while finetune/recipe_trainer.py still imports it from here: this module *is*
`finetune.recipe` (the same module object), so either name sees the same attributes."""

import sys

import finetune.recipe

sys.modules[__name__] = finetune.recipe
