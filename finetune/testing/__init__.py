"""What exactness is proved with: the float64 brute force (`reference`: one sequence at a time, unpadded) and the
tiny models, ragged rows and SGD recording harness (`toy`). The tests, scripts/exactness.py and `verify` use them.

It imports torch, transformers and finetune.core only.
"""
