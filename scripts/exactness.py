"""The exactness table of the README: applied gradient vs the float64 per-sequence reference, ours and Trainer's.

    OMP_NUM_THREADS=2 python scripts/exactness.py

For each model (a tiny Llama, a tiny Qwen2.5-VL with `accepts_loss_kwargs = False`, a plain nn.Module returning a
per-batch mean loss) and each (micro-batch, accumulation) case, trains with SGD lr 1 (the parameter change is the
applied gradient) and prints the largest relative error over the run's optimizer steps.

Self-contained (scripts import nothing from tests/): the tiny models, the ragged rows, the recording harness and the
float64 brute force below are copies of tests/toy.py, tests/test_trainer.py's harness and tests/reference.py, which the
tests keep for themselves.
"""

from __future__ import annotations

import copy
import random
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from finetune import TokenNormTrainer

CASES = {
    "micro 8 × acc 1": (8, 1, 16),
    "micro 1 × acc 8": (1, 8, 16),
    "uneven micro-batches": (4, 3, 10),
    "partial final window": (2, 4, 10),
}

# ---- tiny models, ragged rows, recording (as tests/toy.py) ----

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
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
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
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


class RecordingCollator:
    """Right-pads like any SFT collator and records the rows of every micro-batch in the order they are consumed."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id
        self.batches: list[list[dict]] = []

    def __call__(self, rows):
        self.batches.append([dict(r) for r in rows])
        width = max(len(r["input_ids"]) for r in rows)
        pad = lambda seq, value: list(seq) + [value] * (width - len(seq))  # noqa: E731
        return {
            "input_ids": torch.tensor([pad(r["input_ids"], self.pad_id) for r in rows]),
            "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows]),
            "labels": torch.tensor([pad(r["labels"], -100) for r in rows]),
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


# ---- the float64 brute force (as tests/reference.py): one sequence at a time, unpadded ----


def reference_gradient(model, sequences, forward=None, shift=True, label_smoothing=0.0):
    """Token-mean next-token cross-entropy gradient over `sequences` (dicts of 1-D input_ids/labels[, extra]).

    Returns ({name: float64 grad}, float64 loss). `forward(model, seq)` returns [1, T, V] logits for one sequence.
    shift=False: position t predicts labels[t] (masked LM, token classification, a seq2seq decoder's logits).
    label_smoothing ε: each target's loss is (1 − ε)·(−log p[target]) + ε·mean over classes of (−log p).
    """
    ref = copy.deepcopy(model).to(torch.float64)
    ref.train()
    for module in ref.modules():  # dropout off: the reference is the deterministic gradient
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ref.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), dtype=torch.float64)
    total_targets = 0
    per_sequence = []
    for seq in sequences:
        ids = torch.as_tensor(seq["input_ids"]).unsqueeze(0)
        labels = torch.as_tensor(seq["labels"])
        logits = forward(ref, seq) if forward else ref(input_ids=ids)["logits"]  # ModelOutput or dict
        logits = logits[0].to(torch.float64)
        seq_loss = torch.zeros((), dtype=torch.float64)
        offset = 1 if shift else 0
        for t in range(len(labels) - offset):
            target = int(labels[t + offset])
            if target == -100:
                continue
            log_p = torch.log_softmax(logits[t], dim=-1)
            seq_loss = seq_loss - (1 - label_smoothing) * log_p[target] - label_smoothing * log_p.mean()
            total_targets += 1
        per_sequence.append(seq_loss)
    total_loss = torch.stack(per_sequence).sum()
    if total_targets == 0:
        return {n: torch.zeros_like(p) for n, p in ref.named_parameters()}, 0.0
    mean_loss = total_loss / total_targets
    mean_loss.backward()
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in ref.named_parameters()
    }
    return grads, float(mean_loss.detach())


def relative_error(applied: dict, reference: dict) -> float:
    num = sum(float(((applied[n].double() - reference[n]) ** 2).sum()) for n in reference)
    den = sum(float((reference[n] ** 2).sum()) for n in reference)
    return (num / den) ** 0.5


# ---- training and checking each step (as tests/test_trainer.py) ----


def train_recording(trainer_cls, model, rows, output_dir, micro, accumulation):
    collator, snapshots = RecordingCollator(), SnapshotCallback()
    trainer = trainer_cls(
        model=model,
        args=sgd_args(output_dir, micro, accumulation),
        train_dataset=rows,
        data_collator=collator,
        callbacks=[snapshots],
    )
    trainer.train()
    windows = [sum(collator.batches[i : i + accumulation], []) for i in range(0, len(collator.batches), accumulation)]
    return trainer, windows, snapshots.snapshots


def model_at(initial, snapshot):
    model = copy.deepcopy(initial)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(snapshot[name])
    return model


def step_errors(initial, windows, snapshots):
    """Per optimizer step: (relative error of the applied gradient, reference token-mean loss)."""
    results = []
    for k, window in enumerate(windows):
        grads, loss = reference_gradient(model_at(initial, snapshots[k]), window)
        applied = {n: snapshots[k][n] - snapshots[k + 1][n] for n in grads}
        results.append((relative_error(applied, grads), loss))
    return results


MODELS = {"llama": tiny_llama, "qwen2_5_vl": tiny_qwen_vl, "mean_loss_module": MeanLossLM}


def worst_error(trainer_cls, model_name, micro, accumulation, rows) -> float:
    initial = MODELS[model_name]()
    with tempfile.TemporaryDirectory() as out:
        _, windows, snapshots = train_recording(
            trainer_cls, copy.deepcopy(initial), ragged_rows(rows, seed=rows + micro), Path(out), micro, accumulation
        )
    return max(error for error, _ in step_errors(initial, windows, snapshots))


EVAL_BATCHES = (1, 3, 7, 16)


def eval_errors(trainer_cls, model_name) -> list[float]:
    """Relative error of `evaluate()["eval_loss"]` against the float64 token mean of the whole eval set (23 rows of
    4–48 tokens), at each eval batch size."""
    model, rows = MODELS[model_name](), ragged_rows(23, seed=9, min_len=4, max_len=48)
    _, reference = reference_gradient(model, rows)
    errors = []
    for batch in EVAL_BATCHES:
        with tempfile.TemporaryDirectory() as out:
            args = sgd_args(Path(out), 1, 1)
            args.per_device_eval_batch_size = batch
            trainer = trainer_cls(model=model, args=args, eval_dataset=rows, data_collator=RecordingCollator())
            errors.append(abs(trainer.evaluate()["eval_loss"] - reference) / reference)
    return errors


def main() -> None:
    print("| model | case | TokenNormTrainer | transformers.Trainer |\n|---|---|---|---|")
    for model_name in MODELS:
        for case, (micro, accumulation, rows) in CASES.items():
            ours = worst_error(TokenNormTrainer, model_name, micro, accumulation, rows)
            stock = worst_error(Trainer, model_name, micro, accumulation, rows)
            print(f"| {model_name} | {case} | {ours:.1e} | {stock:.1e} |", flush=True)
    print(
        f"\n| model | eval_loss at eval batch {' / '.join(map(str, EVAL_BATCHES))} | TokenNormTrainer | "
        "transformers.Trainer |\n|---|---|---|---|"
    )
    for model_name in ("llama", "mean_loss_module"):
        ours, stock = (
            " / ".join(f"{e:.1e}" for e in eval_errors(cls, model_name)) for cls in (TokenNormTrainer, Trainer)
        )
        print(f"| {model_name} | relative error vs the float64 token mean | {ours} | {stock} |", flush=True)


if __name__ == "__main__":
    main()
