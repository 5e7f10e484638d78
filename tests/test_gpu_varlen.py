"""GPU tier: packed rows through torch's varlen_attn on CUDA, against per-sequence attention.

Bounds in bf16: the varlen kernel and per-sequence sdpa (flash kernels both, on CUDA) keep fp32 accumulators and round
their inputs, the probabilities before P·V and their outputs to bf16 (8 significant bits, unit roundoff 2^-9). So the
varlen kernel's error against float64 must stay within twice per-sequence sdpa's own error (the computation it
replaces, rounded alike) plus a few units of roundoff of the output's scale: `err <= 2 * err_sdpa + 2^-7 * scale`.
"""

import copy
import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from finetune import TokenNormTrainer
from finetune.data.batching import row_collator
from finetune.model.packed_attention import PackedAttention, register
from finetune.model.varlen_attention import VarlenKernel, torch_varlen_attn
from finetune.recipe import Batching
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import VOCAB, SnapshotCallback, model_at, ragged_rows
from tests.attention import per_sequence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LENGTHS = [1, 2, 37, 64, 5, 130, 17]  # the edges: one- and two-token sequences, a long one


def varlen_or_skip():
    fn = torch_varlen_attn()
    if fn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    return fn


def recording(fn, calls: list):
    @functools.wraps(fn)  # keeps the signature VarlenKernel reads
    def call(*args, **kwargs):
        calls.append((args[3], args[5]))  # cu_seq_q, max_q
        return fn(*args, **kwargs)

    return call


def within(err: float, err_sdpa: float, scale: float) -> bool:
    return err <= 2 * err_sdpa + 2**-7 * scale


def attention_inputs(dtype=torch.bfloat16, heads=8, kv_heads=2, head_dim=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)

    def make(heads_of_it):
        return torch.randn(1, heads_of_it, total, head_dim, device="cuda", dtype=dtype, generator=g)

    q, k, v = make(heads).requires_grad_(), make(kv_heads).requires_grad_(), make(kv_heads).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads
    kwargs = dict(
        scaling=head_dim**-0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS)
    )
    return module, q, k, v, kwargs


def test_varlen_attn_matches_per_sequence_attention_in_bf16_forward_and_backward():
    varlen, loop = PackedAttention(VarlenKernel(varlen_or_skip())), PackedAttention(None)
    module, q, k, v, kwargs = attention_inputs()
    weights = torch.randn(1, sum(LENGTHS), q.shape[1], q.shape[-1], device="cuda", dtype=torch.float64)
    results = {}
    for name, attention in (("varlen", varlen), ("sdpa", loop)):
        out, _ = attention(module, q, k, v, None, **kwargs)
        results[name] = (out.double(), *torch.autograd.grad((out.double() * weights).sum(), (q, k, v)))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    cu = kwargs["cu_seq_lens_q"].tolist()
    out64 = per_sequence(*(t[0].transpose(0, 1) for t in (q64, k64, v64)), cu, kwargs["scaling"]).unsqueeze(0)
    reference = (out64, *torch.autograd.grad((out64 * weights).sum(), (q64, k64, v64)))
    for i, what in enumerate(("output", "dq", "dk", "dv")):
        err = {name: float((results[name][i] - reference[i]).abs().max()) for name in results}
        scale = float(reference[i].abs().max())
        assert within(err["varlen"], err["sdpa"], scale), (what, err, scale)


def test_a_packed_layer_makes_no_host_sync():
    attention = PackedAttention(VarlenKernel(varlen_or_skip()))
    module, q, k, v, kwargs = attention_inputs()
    attention(module, q, k, v, None, **kwargs)[0].sum().backward()  # warm-up: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = attention(module, q, k, v, None, **kwargs)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def small_llama(seed: int = 0) -> LlamaForCausalLM:
    """Head size 64 (the tiny test models' 8 is below what one would run on a GPU)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def test_a_packed_bf16_model_runs_one_varlen_call_per_layer():
    calls = []
    register(PackedAttention(VarlenKernel(recording(varlen_or_skip(), calls))), "gpu_varlen")
    register(PackedAttention(None), "gpu_per_sequence")
    model = small_llama()
    rows = ragged_rows(12, seed=1, min_len=2, max_len=120)
    batch = {
        k: v.cuda() if isinstance(v, torch.Tensor) else v
        for k, v in row_collator(Batching("packed", 1, None), None)([dict(r) for r in rows]).items()
    }
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = {}
    for name, dtype in (
        ("gpu_varlen", torch.bfloat16),
        ("gpu_per_sequence", torch.bfloat16),
        ("gpu_per_sequence", torch.float64),
    ):
        copy_ = copy.deepcopy(model).to("cuda", dtype)
        copy_.config._attn_implementation = name
        with torch.no_grad():
            logits[name, dtype] = copy_(**inputs, use_cache=False).logits[0].double()
    assert len(calls) == model.config.num_hidden_layers
    assert all(cu is batch["cu_seq_lens_q"] and m == batch["max_length_q"] for cu, m in calls)
    reference = logits["gpu_per_sequence", torch.float64]
    err = {
        name: float((logits[name, torch.bfloat16] - reference).abs().max())
        for name in ("gpu_varlen", "gpu_per_sequence")
    }
    assert within(err["gpu_varlen"], err["gpu_per_sequence"], float(reference.abs().max())), err


def train_packed(initial, attention_name: str, tmp_path):
    """Two optimizer steps of 2 micro-batches of 3 packed rows, bf16 autocast on CUDA, SGD lr 1."""
    model = copy.deepcopy(initial)
    model.config._attn_implementation = attention_name
    collate, seen = row_collator(Batching("packed", 1, None), None), []

    def recording_collator(rows):
        seen.append([dict(r) for r in rows])
        return collate(rows)

    args = TrainingArguments(
        output_dir=str(tmp_path / attention_name),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        seed=0,
        remove_unused_columns=False,
        bf16=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    snapshots = SnapshotCallback()
    TokenNormTrainer(
        model=model,
        args=args,
        train_dataset=ragged_rows(12, seed=4, min_len=2, max_len=60),
        data_collator=recording_collator,
        callbacks=[snapshots],
    ).train()
    return seen, snapshots.snapshots


def test_a_packed_training_step_on_cuda_is_as_exact_as_per_sequence_attention(tmp_path):
    calls = []
    register(PackedAttention(VarlenKernel(recording(varlen_or_skip(), calls))), "gpu_varlen")
    register(PackedAttention(None), "gpu_per_sequence")
    initial = small_llama()
    errors = {}
    for name in ("gpu_varlen", "gpu_per_sequence"):
        seen, snapshots = train_packed(initial, name, tmp_path)
        windows = [seen[0] + seen[1], seen[2] + seen[3]]
        errors[name] = []
        for k, window in enumerate(windows):
            grads, _ = reference_gradient(model_at(initial, {n: t.cpu() for n, t in snapshots[k].items()}), window)
            applied = {n: (snapshots[k][n] - snapshots[k + 1][n]).cpu() for n in grads}
            errors[name].append(relative_error(applied, grads))
    # every micro-batch's every layer ran the kernel, fed by its collator's bounds on the device
    assert len(calls) >= 4 * initial.config.num_hidden_layers
    assert all(cu.is_cuda and cu.dtype == torch.int32 for cu, _ in calls)
    for varlen, per_seq in zip(errors["gpu_varlen"], errors["gpu_per_sequence"]):
        assert varlen <= 2 * per_seq + 2**-7, errors
