"""Generated samples at each evaluation: greedy generation from a few fixed prompts (finetune/evaluation/prompts.py),
printed on rank 0 and logged to W&B as one table of every evaluation so far (step, prompt, output, reference).

The model generates in eval mode without gradients, with its KV cache on, and goes back to the mode and cache setting
it had. Every rank generates (FSDP and ZeRO-3 gather weights in each forward, so all ranks must run them); on more
than one rank every prompt runs exactly `eval.max_new_tokens` steps, so no rank stops before another, and the output
is cut at the end-of-sequence token. Greedy generation draws no random numbers: a resumed run stays bitwise the same.
"""

from __future__ import annotations

import copy
import sys

from tqdm.auto import tqdm
from transformers import TrainerCallback

from finetune.env import world_size

COLUMNS = ["step", "prompt", "output", "reference"]
CONSOLE_CHARS = 200  # a sample's output on the console; W&B gets it whole


def _one_line(text: str, limit: int = CONSOLE_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _end_ids(config, tokenizer) -> set[int]:
    ends = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    return set(ends if isinstance(ends, (list, tuple)) else [ends] if ends is not None else [])


def generate(model, processing_class, prompts: list, max_new_tokens: int, same_length: bool = False) -> list[str]:
    """The greedy continuation of each prompt (`SamplePrompt.inputs`), decoded without special tokens."""
    import torch

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    config = copy.deepcopy(model.generation_config)
    config.update(
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        use_cache=True,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens if same_length else None,
    )
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ends = _end_ids(config, tokenizer)
    parameter = next(model.parameters())
    was_training, cache = model.training, getattr(model.config, "use_cache", None)
    outputs = []
    model.eval()
    try:
        with torch.no_grad():
            for prompt in prompts:
                inputs = {
                    k: v.to(parameter.device, parameter.dtype if v.is_floating_point() else v.dtype)
                    for k, v in prompt.inputs.items()
                }
                new = model.generate(**inputs, generation_config=config)[0, inputs["input_ids"].shape[1] :].tolist()
                stop = next((i for i, token in enumerate(new) if token in ends), len(new))
                outputs.append(tokenizer.decode(new[:stop], skip_special_tokens=True).strip())
    finally:
        model.train(was_training)
        if cache is not None:
            model.config.use_cache = cache
    return outputs


def log_table(rows: list[list], step: int) -> None:
    """The samples of every evaluation so far, as the W&B table `eval/samples` (where a W&B run is open)."""
    wandb = sys.modules.get("wandb")
    if wandb is None or getattr(wandb, "run", None) is None:
        return
    wandb.run.log(
        {"eval/samples": wandb.Table(columns=COLUMNS, data=[list(r) for r in rows]), "train/global_step": step}
    )


class GenerateSamples(TrainerCallback):
    """At each evaluation: a greedy sample from each prompt; the console and the W&B table on rank 0."""

    def __init__(self, prompts: list, max_new_tokens: int):
        self.prompts, self.max_new_tokens = prompts, max_new_tokens
        self.rows: list[list] = []  # [step, prompt, output, reference] of this process's evaluations

    def on_evaluate(self, args, state, control, model=None, processing_class=None, **kwargs):
        outputs = generate(model, processing_class, self.prompts, self.max_new_tokens, world_size() > 1)
        if not state.is_world_process_zero:
            return
        lines = []
        for prompt, output in zip(self.prompts, outputs):
            self.rows.append([state.global_step, prompt.shown, output, prompt.reference])
            lines.append(f"  {prompt.name}: {_one_line(prompt.shown, 120)}")
            lines.append(f"    model:     {_one_line(output)}")
            if prompt.reference:
                lines.append(f"    reference: {_one_line(prompt.reference)}")
        tqdm.write("\n".join(lines))
        log_table(self.rows, state.global_step)
