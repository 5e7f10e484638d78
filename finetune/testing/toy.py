"""Tiny models, ragged rows and the SGD recording harness with which the exactness tests and scripts/exactness.py
check a trainer against the float64 reference (`finetune.testing.reference`), built from configs: nothing to download.

With SGD, lr 1 and no momentum or decay, the parameter change of a step is minus the gradient the trainer applied,
so `train_recording` + `step_errors` check every step of a run against the rows its window really held.
"""

from __future__ import annotations

import copy
import random

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from finetune.core.labels import IGNORE_INDEX
from finetune.testing.reference import reference_gradient, relative_error

VOCAB = 61


def tiny_llama(seed: int = 0, vocab: int = VOCAB, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def tiny_qwen_vl(seed: int = 0):
    """Qwen2.5-VL sets `accepts_loss_kwargs = False`: Trainer falls back to per-micro-batch means for it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0]
        ),
        image_token_id=VOCAB - 1,
        video_token_id=VOCAB - 2,
        vision_start_token_id=VOCAB - 3,
        attn_implementation="sdpa",
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    assert model.accepts_loss_kwargs is False
    return model


class MeanLossLM(nn.Module):
    """A research-style module: returns a per-batch *mean* loss when given labels, and logits."""

    # transformers' convention for "my logits are a causal LM's": TokenNormTrainer normalizes it (without it, a
    # plain module is trained by Trainer's own loss)
    loss_type = "ForCausalLM"

    def __init__(self, vocab: int = VOCAB, width: int = 24, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed(input_ids)
        # causal running mean: position t sees tokens ≤ t only, so right padding cannot change real positions
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = torch.tanh(self.mix(x.cumsum(1) / steps))
        logits = self.head(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
            )
        return out


def ragged_rows(n: int, seed: int = 0, min_len: int = 3, max_len: int = 24, vocab: int = VOCAB) -> list[dict]:
    """Rows of very different lengths; a random prompt prefix has no targets, as in SFT."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(1, vocab - 3) for _ in range(length)]
        prompt = rng.randint(0, length - 2)
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return rows


class RecordingCollator:
    """Right-pads like any SFT collator and records the rows of every micro-batch in the order they are consumed."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id
        self.batches: list[list[dict]] = []

    def __call__(self, rows):
        self.batches.append([dict(r) for r in rows])
        width = max(len(r["input_ids"]) for r in rows)

        def pad(seq, value):
            return list(seq) + [value] * (width - len(seq))

        return {
            "input_ids": torch.tensor([pad(r["input_ids"], self.pad_id) for r in rows]),
            "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows]),
            "labels": torch.tensor([pad(r["labels"], IGNORE_INDEX) for r in rows]),
        }


class SnapshotCallback(TrainerCallback):
    """Parameters before training and after every optimizer step (float64 copies)."""

    def __init__(self):
        self.snapshots: list[dict[str, torch.Tensor]] = []

    @staticmethod
    def take(model):
        return {n: p.detach().to(torch.float64).clone() for n, p in model.named_parameters()}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshots = [self.take(model)]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshots.append(self.take(model))


def sgd_args(output_dir, micro: int, accumulation: int, max_steps: int = -1, max_grad_norm: float = 0.0, **extra):
    """SGD with lr 1 and no momentum or decay: the parameter change equals minus the applied gradient."""
    return TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        max_steps=max_steps,
        num_train_epochs=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=max_grad_norm,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


def train_recording(
    trainer_cls, model, rows, output_dir, micro, accumulation, collator=None, trainer_kwargs=None, **args
):
    """Train `model` on `rows` with SGD lr 1 (`args`: more TrainingArguments). Returns (trainer, each window's rows,
    the parameters before training and after each step). `collator`: a RecordingCollator (or one that records alike)."""
    collator, snapshots = collator or RecordingCollator(), SnapshotCallback()
    trainer = trainer_cls(
        model=model,
        args=sgd_args(output_dir, micro, accumulation, **args),
        train_dataset=rows,
        data_collator=collator,
        callbacks=[snapshots],
        **(trainer_kwargs or {}),
    )
    trainer.train()
    windows = [sum(collator.batches[i : i + accumulation], []) for i in range(0, len(collator.batches), accumulation)]
    return trainer, windows, snapshots.snapshots


def model_at(initial, snapshot):
    """A copy of `initial` with the parameters of `snapshot`."""
    model = copy.deepcopy(initial)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(snapshot[name])
    return model


def step_errors(initial, windows, snapshots, **reference):
    """Per optimizer step: (relative error of the applied gradient, reference token-mean loss). `reference`: how the
    reference reads the model (`forward`, `shift`, `label_smoothing` of `reference_gradient`)."""
    if len(snapshots) != len(windows) + 1:
        raise ValueError(f"{len(snapshots)} parameter snapshots for {len(windows)} windows: one per step, plus one")
    results = []
    for k, window in enumerate(windows):
        grads, loss = reference_gradient(model_at(initial, snapshots[k]), window, **reference)
        applied = {n: snapshots[k][n] - snapshots[k + 1][n] for n in grads}
        results.append((relative_error(applied, grads), loss))
    return results
