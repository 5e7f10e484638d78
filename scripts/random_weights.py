"""A causal LM with random weights from a folder of its config and tokenizer (scripts/gpu_carry.py's DIR/smollm2):
a model folder `from_pretrained` loads, for the steps that measure speed, not what the weights know.

    python scripts/random_weights.py .carry/smollm2 /tmp/smollm2-random
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    source, target = Path(argv[0]), Path(argv[1])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
    model.save_pretrained(target)  # safetensors
    for path in source.iterdir():
        if path.is_file() and not (target / path.name).exists():  # the tokenizer and generation files
            shutil.copy2(path, target / path.name)
    print(f"random_weights: {model.num_parameters() / 1e6:.0f}M parameters, seed 0, in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
