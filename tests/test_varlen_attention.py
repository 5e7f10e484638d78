"""The CUDA path of packed rows, run on a CPU: the collator's bounds reach the varlen kernel call unchanged, and what
the call computes is each sequence alone. Only the CUDA kernel is replaced, by `ReferenceVarlen` (torch's
`varlen_attn` signature, written out one sequence at a time over `cu_seq_q`); the collator, the model's kwargs and
`PackedAttention` are the ones training runs."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from finetune import TokenNormTrainer
from finetune.data.batching import row_collator
from finetune.model import packed_attention
from finetune.model.packed_attention import NAME, PackedAttention
from finetune.model.varlen_attention import VarlenKernel
from finetune.recipe import Batching
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import SnapshotCallback, model_at, ragged_rows, sgd_args, tiny_llama
from tests.attention import alone_logits, per_sequence, rows_with_short_ones, tiny_mha, with_attention

VARLEN_ON_CPU = "packed_varlen_reference"


class ReferenceVarlen:
    """torch's varlen_attn (2.11+ signature) computed one sequence at a time: a softmax over written-out causal
    scores. Records what every call was given."""

    def __init__(self):
        self.calls = []

    def __call__(
        self,
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
    ):
        self.calls.append(
            {
                "cu_q": cu_seq_q,
                "cu_k": cu_seq_k,
                "max_q": max_q,
                "max_k": max_k,
                "q": query.shape,
                "k": key.shape,
                "dtype": query.dtype,
                "gqa": enable_gqa,
                "window": window_size,
            }
        )
        assert window_size == (-1, 0), "not called causally"
        return per_sequence(query, key, value, cu_seq_q.tolist(), scale)


class Varlen210(ReferenceVarlen):
    """torch 2.10's spelling: is_causal, no scale, no enable_gqa."""

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert is_causal and key.shape[1] == query.shape[1]
        self.calls.append({"cu_q": cu_seq_q, "max_q": max_q, "q": query.shape, "k": key.shape})
        return per_sequence(query, key, value, cu_seq_q.tolist(), None)


def on_cpu_varlen(kernel, dtypes=(torch.float64,)) -> PackedAttention:
    """PackedAttention with `kernel` standing in for the CUDA kernel, taking CPU calls in `dtypes`."""
    attention = PackedAttention(VarlenKernel(kernel, device="cpu", dtypes=dtypes))
    packed_attention.register(attention, VARLEN_ON_CPU)
    return attention


def packed_batch(rows) -> dict:
    return row_collator(Batching("packed", 1, None), tokenizer=None)([dict(r) for r in rows])


def summed_loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], reduction="sum", ignore_index=-100)


def test_the_packed_collator_gives_each_sequences_bounds_and_positions():
    rows = rows_with_short_ones(seed=3)
    lengths = [len(r["input_ids"]) for r in rows]
    batch = packed_batch(rows)
    cu = batch["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert torch.equal(batch["cu_seq_lens_k"], cu)
    assert batch["max_length_q"] == batch["max_length_k"] == max(lengths) and isinstance(batch["max_length_q"], int)
    positions, edges = batch["position_ids"][0], cu.tolist()
    for start, end in zip(edges, edges[1:]):  # positions restart at every sequence; no target crosses a boundary
        assert positions[start:end].tolist() == list(range(end - start)) and batch["labels"][0, start] == -100


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_the_varlen_path_is_fed_the_collators_bounds_and_computes_each_sequence_alone(kind):
    kernel = ReferenceVarlen()
    on_cpu_varlen(kernel)
    model = (tiny_llama() if kind == "gqa" else tiny_mha()).to(torch.float64)
    varlen, loop = with_attention(copy.deepcopy(model), VARLEN_ON_CPU), with_attention(copy.deepcopy(model), NAME)
    rows = rows_with_short_ones(seed=2)
    batch = packed_batch(rows)
    loss = summed_loss(varlen, batch)
    # one call per layer, each given the very tensor the collator made (nothing re-derived) and its max length
    layers, config = model.config.num_hidden_layers, model.config
    assert len(kernel.calls) == layers
    total, head_dim = batch["input_ids"].shape[1], config.hidden_size // config.num_attention_heads
    for call in kernel.calls:
        assert call["cu_q"] is batch["cu_seq_lens_q"] and call["cu_k"] is batch["cu_seq_lens_k"]
        assert call["max_q"] == call["max_k"] == max(len(r["input_ids"]) for r in rows)
        assert call["q"] == (total, config.num_attention_heads, head_dim)
        assert call["k"] == (total, config.num_key_value_heads, head_dim) and call["gqa"] == (kind == "gqa")
    # the logits and gradients are per-sequence sdpa's, and each sequence's alone (eager: its softmax is float32)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = varlen(**inputs, use_cache=False).logits[0]
        assert (logits - loop(**inputs, use_cache=False).logits[0]).abs().max() <= 1e-12
    assert (logits - alone_logits(model, rows)).abs().max() <= 1e-6
    loss.backward()
    reference = summed_loss(loop, batch)
    reference.backward()
    assert abs(loss.item() - reference.item()) <= 1e-10 * abs(reference.item())
    grads = {n: p.grad for n, p in varlen.named_parameters()}
    assert relative_error(grads, {n: p.grad for n, p in loop.named_parameters()}) <= 1e-10


@pytest.mark.parametrize("kernel", [ReferenceVarlen(), Varlen210()], ids=["torch-2.11+", "torch-2.10"])
def test_a_scale_and_grouped_heads_reach_either_kernel_signature(kernel):
    """A non-default softmax scale and grouped kv heads: the kernel's own arguments, or folded into its inputs."""
    attention = PackedAttention(VarlenKernel(kernel, device="cpu", dtypes=(torch.float64,)))
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 2, 7]
    q = torch.randn(1, 4, sum(lengths), 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    out, _ = attention(
        module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7
    )
    assert len(kernel.calls) == 1 and out.shape == (1, sum(lengths), 4, 8)
    want = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=0.3, enable_gqa=True)
            for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ],
        dim=2,
    ).transpose(1, 2)
    assert (out - want).abs().max() <= 1e-12
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected)) <= 1e-12


def test_autocast_runs_the_kernel_in_its_dtype():
    """Under autocast the rotary-embedded query and key are float32: the kernel gets autocast's dtype, as sdpa
    would run in it."""
    kernel = ReferenceVarlen()
    on_cpu_varlen(kernel, dtypes=(torch.bfloat16,))
    model = with_attention(tiny_llama(), VARLEN_ON_CPU)
    batch = packed_batch(rows_with_short_ones(seed=4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        summed_loss(model, batch).backward()
    assert [c["dtype"] for c in kernel.calls] == [torch.bfloat16] * model.config.num_hidden_layers
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_calls_the_kernel_cannot_take_run_per_sequence_with_one_warning_each(caplog):
    kernel = ReferenceVarlen()
    attention = on_cpu_varlen(kernel)  # float64 only: a float32 model is a call it cannot take
    model = with_attention(tiny_llama(), VARLEN_ON_CPU)
    rows = rows_with_short_ones(seed=6)
    batch = packed_batch(rows)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        first = model(**inputs, use_cache=False).logits[0]
        model(**inputs, use_cache=False)
        no_bounds = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    assert kernel.calls == []
    assert (first.double() - alone_logits(model, rows)).abs().max() <= 1e-5 and torch.equal(first, no_bounds)
    assert sorted(attention.warned) == [
        "attention in float32 (the varlen kernel takes float64: train in bf16)",
        "the batch has no cu_seq_lens_q/max_length_q (the packed collator sets them)",
    ]
    assert caplog.text.count("run causal sdpa per sequence") == 2  # once per reason, not once per layer or call


def test_packed_training_through_the_varlen_path_is_exact(tmp_path):
    """TokenNormTrainer with the recipe's packed collator on the varlen path: each window's update is the float64
    brute-force gradient (the batch's bounds go through the Trainer's input preparation to every layer)."""
    kernel = ReferenceVarlen()
    on_cpu_varlen(kernel, dtypes=(torch.float32,))
    initial = with_attention(tiny_llama(), "eager")
    trained = with_attention(copy.deepcopy(initial), VARLEN_ON_CPU)
    collate, seen = row_collator(Batching("packed", 1, None), tokenizer=None), []

    def recording(rows):
        seen.append([dict(r) for r in rows])
        return collate(rows)

    snapshots = SnapshotCallback()
    rows = ragged_rows(10, seed=4) + [{"input_ids": [3], "labels": [3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    trainer = TokenNormTrainer(
        model=trained, args=sgd_args(tmp_path, 3, 2), train_dataset=rows, data_collator=recording, callbacks=[snapshots]
    )
    trainer.train()
    assert len(kernel.calls) == 4 * trained.config.num_hidden_layers  # every micro-batch's every layer
    for k, window in enumerate([seen[0] + seen[1], seen[2] + seen[3]]):
        grads, _ = reference_gradient(model_at(initial, snapshots.snapshots[k]), window)
        applied = {n: snapshots.snapshots[k][n] - snapshots.snapshots[k + 1][n] for n in grads}
        assert relative_error(applied, grads) <= 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_without_cuda_packed_rows_run_per_sequence():
    model = LlamaForCausalLM(tiny_llama().config)
    line = packed_attention.use_for_packed_rows(model, "data.batching=padded")
    assert model.config._attn_implementation == NAME and "varlen" not in line
    assert packed_attention.register().varlen is None
