"""The tiny GRPO harness with which the tests, scripts/grpo_exactness.py and `grpo_check` train a GRPO trainer and
compare every optimizer step with the float64 brute force (finetune/rl/grpo_reference.py): a word-level tokenizer
and a tiny Llama written to a folder (TRL builds its reference model from the policy's folder), prompts of a few
words, a deterministic reward, and a trainer subclass that records the micro-batches its loss saw and the gradient
each optimizer step applied. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig

from finetune.rl.grpo_reference import Objective, window_objective_gradient
from finetune.testing.reference import relative_error
from finetune.testing.toy import model_at, tiny_llama

WORDS = ("a", "b", "c", "d", "e", "f", "g", "h")
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")  # Llama's defaults: pad 0, bos 1, eos 2


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate((*SPECIAL, *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    )


def tiny_policy_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny Llama over the word vocabulary and its tokenizer, saved: what GRPOTrainer loads (and its reference
    model from, where beta > 0)."""
    model = tiny_llama(seed=seed, vocab=len(SPECIAL) + len(WORDS))
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def prompts(n: int = 16) -> Dataset:
    return Dataset.from_list([{"prompt": " ".join(WORDS[(i + j) % 8] for j in range(2 + i % 3))} for i in range(n)])


def count_reward(completions, **kwargs) -> list[float]:
    """Deterministic: one per "a", minus 0.3 per word (completions of different lengths get different rewards)."""
    return [c.split().count("a") - 0.3 * len(c.split()) for c in completions]


def sgd_config(output_dir, accumulation: int, steps_per_generation: int, **extra) -> GRPOConfig:
    """SGD lr 1, no decay, clipping or schedule; 4 completions of ≤ 8 tokens per prompt, micro-batches of 4."""
    settings = dict(
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2, learning_rate=1.0,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=False, logging_steps=1,
    )  # fmt: skip
    settings.update(extra)
    return GRPOConfig(
        output_dir=str(output_dir), gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation, **settings,
    )  # fmt: skip


class StepRecorder(TrainerCallback):
    """The parameters before every optimizer step and the gradient it applied (float64 copies)."""

    def __init__(self):
        self.before: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = dict(model.named_parameters())
        self.before.append({n: p.detach().double().clone() for n, p in params.items()})
        zero = torch.zeros_like
        self.grads.append({n: (zero(p) if p.grad is None else p.grad).double() for n, p in params.items()})


def recording(trainer_cls: type) -> type:
    """`trainer_cls` whose `compute_loss` keeps a copy of each training micro-batch it is given (`seen`)."""

    class Recording(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen: list[dict[str, torch.Tensor]] = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.model.training:
                self.seen.append({k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super().compute_loss(model, inputs, *args, **kwargs)

    Recording.__name__ = Recording.__qualname__ = f"Recording{trainer_cls.__name__}"
    return Recording


def train_grpo(trainer_cls: type, folder: Path, args: GRPOConfig, rows: Dataset | None = None):
    """(trainer, StepRecorder) after training a recording `trainer_cls` on the tiny policy in `folder`."""
    recorder = StepRecorder()
    trainer = recording(trainer_cls)(
        model=str(folder), reward_funcs=count_reward, args=args, train_dataset=rows or prompts(),
        processing_class=word_tokenizer(), callbacks=[recorder],
    )  # fmt: skip
    trainer.train()
    return trainer, recorder


def step_errors(trainer, recorder: StepRecorder, folder: Path) -> list[float]:
    """Per optimizer step: ‖applied gradient − float64 gradient of the window's objective‖ / ‖the latter‖."""
    initial = LlamaForCausalLM.from_pretrained(folder)
    objective, accumulation = Objective.of(trainer.args), trainer.args.gradient_accumulation_steps
    errors = []
    for k, grads in enumerate(recorder.grads):
        window = trainer.seen[k * accumulation : (k + 1) * accumulation]
        reference = window_objective_gradient(model_at(initial, recorder.before[k]), window, objective)
        errors.append(relative_error(grads, reference))
    return errors
