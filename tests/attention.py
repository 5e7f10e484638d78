"""Attention helpers for the packed-rows tests: a tiny multi-head (not grouped-query) Llama, rows with one- and
two-token sequences, the per-sequence brute forces (logits of each sequence alone, attention within each slice) and a
flattening collator that records its rows."""

import copy

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

from finetune.core.labels import IGNORE_INDEX
from finetune.model import packed_attention
from finetune.testing.toy import VOCAB, ragged_rows


def tiny_mha(seed: int = 0) -> LlamaForCausalLM:
    """finetune.testing.toy's tiny Llama without grouped-query attention (as many kv heads as heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def with_attention(model, implementation: str):
    packed_attention.register()
    model.config._attn_implementation = implementation
    return model


def rows_with_short_ones(seed: int) -> list[dict]:
    rows = ragged_rows(5, seed=seed, min_len=3, max_len=20)
    rows.insert(1, {"input_ids": [7], "labels": [7]})  # one token: attends to itself only
    rows.insert(4, {"input_ids": [9, 11], "labels": [9, 11]})
    return rows


def alone_logits(model, rows) -> torch.Tensor:
    """The brute force: every sequence on its own, eager attention (a softmax over written-out scores), float64."""
    reference = with_attention(copy.deepcopy(model), "eager").to(torch.float64)
    with torch.no_grad():
        return torch.cat([reference(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0] for r in rows])


def per_sequence(query, key, value, edges: list[int], scale) -> torch.Tensor:
    """[T, H, d] causal attention within each [edges[i], edges[i+1]) slice; kv heads shared by groups of heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    pieces = []
    for start, end in zip(edges, edges[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [H, n, d]
        scores = q @ k.transpose(1, 2) * scale
        future = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).triu(1)
        pieces.append((scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(pieces)


class RecordingFlattening(DataCollatorWithFlattening):
    """Packs rows as DataCollatorWithFlattening does and records the rows of every micro-batch."""

    def __init__(self):
        super().__init__(return_position_ids=True, separator_id=IGNORE_INDEX)
        self.batches = []

    def __call__(self, rows, *args, **kwargs):
        self.batches.append([dict(r) for r in rows])
        return super().__call__(rows, *args, **kwargs)
