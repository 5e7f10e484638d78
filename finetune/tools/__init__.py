"""The commands: train a recipe (`train`), plan the largest micro-batch that fits (`plan`, with `memory_trials`),
prove that a recipe's training step applies the exact token-mean gradient (`verify`, with `reference_check`, against
the float64 brute force of finetune/testing), and run a launcher so that a stopped run's exit code survives it
(`launcher`: finetune-launch, which imports nothing but the environment).

Each `main(argv)` is what an entry script runs (finetune/train.py, `python -m finetune.plan`, `python -m
finetune.verify`, and the finetune-train/-plan/-verify/-launch console scripts). They are the users of
`finetune.assemble`, never used by it: they may import everything in finetune; nothing but the entry scripts imports
them (the training command calls the planner for `train.micro_batch_size: auto`). Module level imports only the
recipe and the environment, so a recipe mistake is reported before torch loads.
"""
