"""Old name of `finetune.training.optim`, kept while finetune/recipe_trainer.py still imports it from
here: this module *is* `finetune.training.optim` (the same module object), so either name sees and
patches the same attributes."""

import sys

from finetune.training import optim

sys.modules[__name__] = optim
