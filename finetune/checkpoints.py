"""Old name of `finetune.training.checkpoints`, kept while finetune/recipe_trainer.py still imports it from
here: this module *is* `finetune.training.checkpoints` (the same module object), so either name sees and
patches the same attributes."""

import sys

from finetune.training import checkpoints

sys.modules[__name__] = checkpoints
