"""Liger's kernels composed with the trainer: after `apply_liger_kernel_to_llama()` a Llama trains through Liger's
RMSNorm, SwiGLU and RoPE and through this trainer's own head and exact token-mean loss, never Liger's `lce_forward`.
Triton kernels cannot run on a CPU: Liger's modules compute through torch references of the same math here, and
every call is counted."""

import copy
import functools
from collections import Counter

import pytest
import torch

from finetune import TokenNormTrainer
from finetune.core.causal_forward import causal_lm_forward, foreign_forward
from finetune.testing.toy import ragged_rows, step_errors, tiny_llama, train_recording

liger = pytest.importorskip("liger_kernel.transformers")


@pytest.fixture
def liger_llama(monkeypatch) -> Counter:
    """Liger's patch of transformers' Llama, undone after the test; {what ran: calls}."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama import modeling_llama

    for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"):  # restored at teardown
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    rope = modeling_llama.apply_rotary_pos_emb
    calls = Counter()

    def rms_norm(self, x):
        calls["LigerRMSNorm"] += 1
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon))).to(x.dtype)

    def swiglu(self, x):
        calls["LigerSwiGLUMLP"] += 1
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    monkeypatch.setattr(LigerRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(LigerSwiGLUMLP, "forward", swiglu)
    liger.apply_liger_kernel_to_llama()
    assert modeling_llama.LlamaRMSNorm is LigerRMSNorm and modeling_llama.LlamaMLP is LigerSwiGLUMLP
    lce_forward = modeling_llama.LlamaForCausalLM.forward

    @functools.wraps(lce_forward)
    def counted_lce(*args, **kwargs):
        calls["lce_forward"] += 1
        return lce_forward(*args, **kwargs)

    def counted_rope(*args, **kwargs):  # liger_rotary_pos_emb's math, in torch
        calls["liger_rotary_pos_emb"] += 1
        return rope(*args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", counted_lce)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", counted_rope)
    return calls


def test_lce_forward_is_replaced_by_the_causal_forward_and_liger_kernels_stay(liger_llama, tmp_path, caplog):
    initial = tiny_llama()
    assert foreign_forward(initial) == "liger_kernel.transformers.model.llama"
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(12, seed=8), tmp_path, 2, 3
    )
    ran = dict(liger_llama)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert model.forward.__func__ is causal_lm_forward and foreign_forward(model) is None
    assert trainer.chunked_head.head is model.lm_head  # the chunked head takes the base model's hidden states
    layers, forwards = model.config.num_hidden_layers, 6  # 2 steps × 3 micro-batches, each one forward
    assert "lce_forward" not in ran
    assert ran["LigerSwiGLUMLP"] == layers * forwards and ran["liger_rotary_pos_emb"] == layers * forwards
    assert ran["LigerRMSNorm"] == (2 * layers + 1) * forwards
    assert sum("liger_kernel.transformers.model.llama's" in r.getMessage() for r in caplog.records) == 1
    for error, _ in step_errors(initial, windows, snapshots):  # the float64 brute force of each window
        assert error <= 1e-5


def test_a_forward_that_cannot_be_replaced_trains_from_its_full_logits(liger_llama, tmp_path):
    """A model without a base model to drive keeps Liger's forward: no logits_to_keep is passed (it would fail on
    the boolean mask), the trainer takes the full logits, and stays exact."""
    initial = tiny_llama()
    initial.get_decoder = lambda: None  # nothing to drive: the forward stays Liger's
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(12, seed=8), tmp_path, 2, 3
    )
    assert liger_llama["lce_forward"] >= 4 and trainer.chunked_head.keeps_logits is False
    for error, _ in step_errors(initial, windows, snapshots):
        assert error <= 1e-5
