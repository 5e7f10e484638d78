"""A causal LM's own forward where another library replaced it: Liger's `lce_forward` and the like.

`liger_kernel.transformers.apply_liger_kernel_to_llama()` (or `TrainingArguments(use_liger_kernel=True)`) swaps
transformers' Llama classes for its kernels: `LlamaRMSNorm` → `LigerRMSNorm`, `LlamaMLP` → `LigerSwiGLUMLP`,
`apply_rotary_pos_emb` → `liger_rotary_pos_emb`, and `LlamaForCausalLM.forward` → `lce_forward` (on the class, or on
the model instance). The elementwise kernels compute what transformers' modules compute and are kept. The forward is
not: it slices `hidden_states[:, logits_to_keep, :]`, which fails on the [B, T] boolean mask transformers takes
(and the trainer passes), and with labels it returns Liger's own loss instead of logits. `own_forward` puts back the
causal LM forward transformers' classes define (base model → hidden states → `logits_to_keep` → LM head → the
model's loss function if labels are given) on the instance, where the trainer's chunked head and exact token-mean
loss use it as they use transformers' own; the base model keeps Liger's kernels.
"""

from __future__ import annotations

from types import MethodType

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

REPLACING_LIBRARIES = ("liger_kernel",)


def foreign_forward(model: torch.nn.Module) -> str | None:
    """The module of a forward another library put on the model (class or instance) in place of transformers', or
    None."""
    forward = getattr(model, "forward", None)
    module = getattr(getattr(forward, "__func__", forward), "__module__", None) or ""
    return module if module.split(".")[0] in REPLACING_LIBRARIES else None


def causal_lm_forward(self, input_ids=None, labels=None, logits_to_keep: int | torch.Tensor = 0, **kwargs):
    """transformers' `XForCausalLM.forward` (transformers 5.2x, e.g. `LlamaForCausalLM.forward`): the base model, the
    kept positions' hidden states, the LM head, the model's loss function where labels are given."""
    outputs = self.get_decoder()(input_ids=input_ids, **kwargs)
    logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        cache=getattr(outputs, "cache", None),
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def own_forward(model: torch.nn.Module) -> str | None:
    """Where `model`'s forward comes from another library and the model is a base model plus a plain LM head, put
    the causal LM forward back on the instance; the line that says so (None: nothing replaced)."""
    foreign = foreign_forward(model)
    if foreign is None:
        return None
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None or decoder is model or type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return (
            f"{type(model).__name__}.forward is {foreign}'s, which this trainer cannot use with logits kept per "
            "position; it is trained from the full logits that forward returns (exact, slower)"
        )
    model.forward = MethodType(causal_lm_forward, model)
    return (
        f"{type(model).__name__}.forward is {foreign}'s: trained through the base model (its kernels kept) and this "
        "trainer's LM head and exact token-mean loss, not that forward's loss"
    )
