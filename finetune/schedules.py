"""Old name of `finetune.training.schedules`, kept while finetune/recipe_trainer.py still imports it from
here: this module *is* `finetune.training.schedules` (the same module object), so either name sees and
patches the same attributes."""

import sys

from finetune.training import schedules

sys.modules[__name__] = schedules
