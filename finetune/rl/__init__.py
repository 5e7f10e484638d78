"""Reinforcement learning from rewards on the exact window rule: `TokenNormGRPOTrainer` (a `trl.GRPOTrainer`
subclass whose every optimizer step is its window's own objective: the window's summed per-token loss ÷ the window's
loss-mask tokens over all data-parallel ranks, for the token-level loss types), the pure window rules it calls
(`grpo_window`), the float64 brute force of one window's GRPO objective (`grpo_reference`) and the one-step check
against it (`grpo_check`).

It imports torch, transformers, accelerate, datasets, trl, finetune.core and finetune.testing (the float64 harness);
nothing of finetune imports it but the lazy export in finetune/__init__.py, so the supervised drop-in (finetune.core)
never needs trl.
"""
