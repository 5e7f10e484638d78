"""Tiny models of every loss kind, their rows and a collator that pads each key on its own: for the drop-in tests
(and for generating evaluation: its arguments and a compute_metrics that keeps its inputs).

Each `Kind` holds what an independent float64 brute force needs: the model's logits for one sequence alone, and
whether position t predicts labels[t + 1] (causal LM) or labels[t] (token classification, masked LM, seq2seq).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForTokenClassification,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)

from finetune.testing.toy import VOCAB, MeanLossLM, RecordingCollator, ragged_rows, tiny_llama

TAGS = 5


def tiny_bert(head, seed: int = 0, **extra):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        **extra,
    )
    return head(config)


def tiny_token_classifier(seed: int = 0):
    return tiny_bert(BertForTokenClassification, seed, num_labels=TAGS)


def tiny_masked_lm(seed: int = 0):
    return tiny_bert(BertForMaskedLM, seed)


def tiny_t5(seed: int = 0):
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config)


def tiny_gpt2(seed: int = 0):
    """A causal LM whose class name holds no loss type: transformers' Auto mappings say what it is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


def tagged_rows(n: int, seed: int = 0) -> list[dict]:
    """Token classification: a tag per token, -100 on some (sub-word continuations, say)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 24))]
        rows.append({"input_ids": ids, "labels": [rng.randrange(TAGS) if rng.random() < 0.7 else -100 for _ in ids]})
    return rows


def masked_rows(n: int, seed: int = 0) -> list[dict]:
    """Masked LM: about a third of the positions carry their token as a target (at least one per row)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 24))]
        labels = [t if rng.random() < 0.35 else -100 for t in ids]
        labels[0] = ids[0]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def seq2seq_rows(n: int, seed: int = 0) -> list[dict]:
    """Encoder tokens and decoder labels of unrelated lengths (labels only: the model makes its decoder inputs)."""
    rng = random.Random(seed)
    return [
        {
            "input_ids": [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 20))],
            "labels": [rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 12))],
        }
        for _ in range(n)
    ]


def generating_args(output_dir, eval_batch: int, **extra):
    return Seq2SeqTrainingArguments(
        output_dir=str(output_dir),
        per_device_eval_batch_size=eval_batch,
        predict_with_generate=True,
        generation_max_length=8,
        generation_num_beams=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


class MetricInputs:
    """compute_metrics that keeps what it was given (predictions and labels), as a summarization script's would."""

    def __init__(self):
        self.seen = []

    def __call__(self, prediction):
        self.seen.append((np.asarray(prediction.predictions), np.asarray(prediction.label_ids)))
        return {"generated_tokens": float((np.asarray(prediction.predictions) > 0).sum())}


class PadEachCollator(RecordingCollator):
    """Pads input_ids (with an attention mask) and labels each to their own longest row; records the rows."""

    def __call__(self, rows):
        self.batches.append([dict(r) for r in rows])

        def pad(key, value):
            width = max(len(r[key]) for r in rows)
            return torch.tensor([list(r[key]) + [value] * (width - len(r[key])) for r in rows])

        width = max(len(r["input_ids"]) for r in rows)
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
        return {"input_ids": pad("input_ids", self.pad_id), "attention_mask": mask, "labels": pad("labels", -100)}


def logits_alone(model, seq):
    return model(input_ids=torch.as_tensor(seq["input_ids"]).unsqueeze(0)).logits


def decoder_logits_alone(model, seq):
    ids, labels = (torch.as_tensor(seq[k]).unsqueeze(0) for k in ("input_ids", "labels"))
    return model(input_ids=ids, labels=labels).logits


class FallbackModule(MeanLossLM):
    """A plain module with no declared loss type: TokenNormTrainer leaves it to Trainer's own loss."""

    loss_type = None


@dataclass
class Kind:
    model: Callable[[], nn.Module]
    rows: Callable[[int, int], list[dict]]
    forward: Callable
    shift: bool
    kind: str | None


KINDS = {
    "causal_lm": Kind(tiny_llama, ragged_rows, logits_alone, True, "causal_lm"),
    "gpt2": Kind(tiny_gpt2, ragged_rows, logits_alone, True, "causal_lm"),
    "mean_loss_module": Kind(
        MeanLossLM, ragged_rows, lambda m, s: m(torch.as_tensor(s["input_ids"])[None])["logits"], True, "causal_lm"
    ),
    "token_classification": Kind(tiny_token_classifier, tagged_rows, logits_alone, False, "token"),
    "masked_lm": Kind(tiny_masked_lm, masked_rows, logits_alone, False, "token"),
    "seq2seq": Kind(tiny_t5, seq2seq_rows, decoder_logits_alone, False, "seq2seq"),
}
