"""What the trainer needs to know about a model's loss, forward and outputs: its loss kind (as transformers decides
it), what its forward takes, where its logits are in what it returned, and whether its LM head can be used on its
own (the chunked loss)."""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.loss.loss_utils import (
    LOSS_MAPPING,
    ForCausalLMLoss,
    ForMaskedLMLoss,
    ForSequenceClassificationLoss,
    ForTokenClassification,
)
from transformers.trainer_utils import unwrap_peft_model

from finetune.core.labels import IGNORE_INDEX
from finetune.core.loss import CAUSAL_LM, SAMPLE, SEQ2SEQ, TOKEN


def _registered_loss_types() -> dict[str, str]:
    """Class name → loss type for the classes transformers' Auto mappings register as causal LM, masked LM, token
    classification, seq2seq or image/speech-to-text heads (GPT2LMHeadModel has no loss type in its name)."""
    from transformers.models.auto import modeling_auto as auto

    registered = {}
    for mapping, loss_type in (
        (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "ForCausalLM"),
        (auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "ForConditionalGeneration"),
        (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "ForConditionalGeneration"),
        (auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, "ForConditionalGeneration"),
        (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, "ForMaskedLM"),
        (auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, "ForTokenClassification"),
    ):
        for names in mapping.values():
            for name in (names,) if isinstance(names, str) else names:
                registered.setdefault(name, loss_type)
    return registered


def loss_type_of(model: torch.nn.Module) -> str | None:
    """The model's `loss_type`; where transformers found none in the class name, the first class of its MRO that the
    Auto mappings register as a language-model head (GPT2LMHeadModel) or whose name holds a loss type (a user's
    subclass such as `MyLlama(LlamaForCausalLM)`). None for anything else (regression models, plain modules)."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type in LOSS_MAPPING:
        return loss_type
    registered = _registered_loss_types()
    for cls in type(model).__mro__:
        if cls.__name__ in registered:
            return registered[cls.__name__]
        found = re.findall(f"({'|'.join(LOSS_MAPPING)})", cls.__name__)
        if found:
            return found[0]
    return None


def loss_kind(model: torch.nn.Module) -> str | None:
    """CAUSAL_LM, TOKEN, SEQ2SEQ or SAMPLE (sequence/image/audio classification, regression, multiple choice) from
    the model's loss type (transformers' LOSS_MAPPING); None: a loss this trainer leaves to Trainer."""
    model = unwrap_peft_model(model)
    if _is_multiple_choice(model):
        return SAMPLE
    loss = LOSS_MAPPING.get(loss_type_of(model))
    if loss is ForCausalLMLoss:  # encoder-decoders feed right-shifted decoder inputs: their labels are unshifted
        return SEQ2SEQ if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else CAUSAL_LM
    if loss in (ForMaskedLMLoss, ForTokenClassification):
        return TOKEN
    if loss is ForSequenceClassificationLoss:
        return SAMPLE
    return None


def _is_multiple_choice(model: torch.nn.Module) -> bool:
    # transformers has no loss type for multiple choice: its heads compute a cross-entropy over the choices' scores
    return any(cls.__name__.endswith("ForMultipleChoice") for cls in type(model).__mro__)


def problem_type_of(model: torch.nn.Module, labels: torch.Tensor) -> str:
    """The sample-level loss a model computes, decided as `ForSequenceClassificationLoss` decides it (without setting
    it on the config): the config's `problem_type`, else regression for one label, single-label classification for
    integer labels, multi-label otherwise; multiple choice is single-label over the choices."""
    model = unwrap_peft_model(model)
    if _is_multiple_choice(model):
        return "single_label_classification"
    config = getattr(model, "config", None)
    if getattr(config, "problem_type", None):
        return config.problem_type
    if getattr(config, "num_labels", 2) == 1:
        return "regression"
    return "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"


@dataclass(frozen=True)
class ForwardTakes:
    """What a model's forward takes that the trainer passes or withholds."""

    labels_required: bool  # a forward that requires labels gets them; all others are spared a loss never used
    no_cache: dict  # {"use_cache": False} where the forward reads a KV cache, else {}
    logits_to_keep: bool  # logits only where a target is (transformers takes a [B, T] bool mask)
    # a causal LM of transformers' own whose right padding reaches a real position only through the attention mask
    right_padding_mask_redundant: bool = False

    def unmasks_right_padding(self, batch: Mapping, targets: torch.Tensor) -> bool:
        """Whether a training micro-batch, on the host, may reach the forward without its attention mask: where the
        mask only hides right padding whose positions have no target. In a causal LM a real position never sees a
        later one, so every real position's output is the same without it (exact); attention then has no mask to
        read back (transformers' sdpa reads a padded mask twice per forward) and runs its causal kernel."""
        return self.right_padding_mask_redundant and is_right_padding(batch.get("attention_mask"), targets)

    def inputs(self, model: torch.nn.Module, batch: Mapping, seq2seq: bool) -> dict:
        """The forward's inputs from a batch: labels only where the forward requires them; a seq2seq model gets its
        decoder inputs from the labels as it would make them itself."""
        forward = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        if self.labels_required:
            forward["labels"] = batch["labels"]
        elif seq2seq and "decoder_input_ids" not in batch and "decoder_inputs_embeds" not in batch:
            prepare = getattr(unwrap_peft_model(model), "prepare_decoder_input_ids_from_labels", None)
            if prepare is not None:
                forward["decoder_input_ids"] = prepare(labels=batch["labels"])
            else:
                forward["labels"] = batch["labels"]
        return {**forward, **self.no_cache}


def is_right_padding(mask: Any, targets: torch.Tensor) -> bool:
    """Whether a host [B, T] attention mask of 0/1 is each row's real positions first, then padding without a target."""
    on_host = isinstance(mask, torch.Tensor) and mask.device.type == "cpu"  # a device mask would be read back
    if not on_host or mask.dim() != 2 or mask.shape != targets.shape:
        return False
    mask = mask.to(torch.int8)
    binary = bool(((mask == 0) | (mask == 1)).all())
    return binary and bool((mask[:, 1:] <= mask[:, :-1]).all()) and bool((targets[mask == 0] == IGNORE_INDEX).all())


def _right_padding_mask_redundant(model: torch.nn.Module) -> bool:
    """A decoder-only causal LM that transformers itself defines and registers (a class we can read), whose padding
    enters only through the mask: not an encoder-decoder, not a mixture of experts whose router loss reads the mask,
    and attention that a mask does not shorten (flash attention unpads masked rows instead)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model = unwrap_peft_model(model)
    config = getattr(model, "config", None)
    causal_lms = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return (
        type(model).__name__ in causal_lms
        and type(model).__module__.startswith("transformers.models.")
        and not getattr(config, "is_encoder_decoder", False)
        and not getattr(config, "output_router_logits", False)
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager", "flex_attention")
        and "attention_mask" in inspect.signature(model.forward).parameters
    )


def forward_takes(model: torch.nn.Module) -> ForwardTakes:
    """What `model`'s forward takes. Training never reads a KV cache, and with one transformers does not derive the
    block-diagonal mask of packed rows from their position_ids (attention would cross sequences); a VLM's forward
    takes use_cache through **kwargs, where its config's use_cache says it reads one."""
    forward = inspect.signature(model.forward).parameters
    labels = forward.get("labels")
    takes_cache = "use_cache" in forward or (
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in forward.values())
        and getattr(getattr(model, "config", None), "use_cache", None) is not None
    )
    return ForwardTakes(
        labels_required=labels is not None and labels.default is inspect.Parameter.empty,
        no_cache={"use_cache": False} if takes_cache else {},
        logits_to_keep="logits_to_keep" in forward,
        right_padding_mask_redundant=_right_padding_mask_redundant(model),
    )


# config keys of loss terms a model's own forward adds to `loss` (with labels) that this trainer does not compute:
# Bamba's z-loss (the mean over every position, padding included, of logsumexp(logits)²)
UNPLACED_LOSS_KEYS = ("z_loss_coefficient",)


def text_config_of(config):
    """A config's language model part (a VLM's text config; a text model's config itself; None as is)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def unplaced_loss_keys(config) -> list[str]:
    """`key=value` of each loss term `config` turns on that the model's forward adds and this trainer cannot place
    in the window's token mean; [] where none."""
    text = text_config_of(config)
    return [f"{key}={getattr(text, key)}" for key in UNPLACED_LOSS_KEYS if getattr(text, key, None)]


def unplaced_loss_fields(outputs: Any) -> list[str]:
    """The names of the loss tensors a model returned beside `loss` and the router balancing `aux_loss` (Switch
    Transformers' encoder_z_loss, decoder_aux_loss, …): terms its forward adds to `loss` that this trainer cannot
    place."""
    items = outputs.items() if isinstance(outputs, Mapping) else ()
    placed = ("loss", "aux_loss")
    return [k for k, v in items if k.endswith("loss") and k not in placed and isinstance(v, torch.Tensor)]


def aux_loss_of(outputs: Any) -> torch.Tensor | None:
    """The router balancing loss a mixture of experts returned beside its logits (`aux_loss`), or None."""
    aux = outputs.get("aux_loss") if isinstance(outputs, Mapping) else getattr(outputs, "aux_loss", None)
    return aux if isinstance(aux, torch.Tensor) else None


def logits_of(outputs: Any) -> torch.Tensor | None:
    """The logits in whatever a model returned: a tensor, a ModelOutput/dict, or a tuple."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits
    if isinstance(outputs, (tuple, list)):
        return next((o for o in outputs if isinstance(o, torch.Tensor) and o.dim() >= 2), None)
    return None


def plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head if the chunked loss can use its weight directly: a plain nn.Linear whose parameters are
    ordinary tensors (not FSDP2 DTensors or ZeRO-3 partitions, which exist whole only inside the module's forward),
    in a model that does not visibly rescale or soft-cap its logits after the head."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    if getattr(text, "final_logit_softcapping", None) or getattr(text, "logits_scaling", 1.0) != 1.0:
        return None
    if hasattr(model, "logit_scale"):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not torch.nn.Linear:
        return None
    params = [p for p in (head.weight, head.bias) if p is not None]
    if any(type(p.data) is not torch.Tensor or hasattr(p, "ds_id") for p in params):
        return None
    return head


@contextlib.contextmanager
def head_passes_hidden_states(head: torch.nn.Module):
    """While active, the LM head returns its input: the model returns hidden states where it would return logits."""
    head.forward = lambda hidden_states: hidden_states  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del head.forward


def returned_unchanged(returned: torch.Tensor | None, head_output: torch.Tensor) -> bool:
    """Whether a model returned its LM head's output as it was: the same tensor, or (under mixed precision, where
    accelerate's `convert_outputs_to_fp32` wraps the forward) a float32 copy of it and nothing else."""
    if returned is head_output:
        return True
    if returned is None or returned.shape != head_output.shape or returned.dtype != torch.float32:
        return False
    cast = returned.grad_fn
    if cast is not None and head_output.grad_fn is not None:  # training: read the graph, no host sync
        return cast.name() == "ToCopyBackward0" and cast.next_functions[0][0] is head_output.grad_fn
    return torch.equal(returned, head_output.float())


def forward_through_one_row(model: torch.nn.Module, forward: dict, head: torch.nn.Module):
    """(outputs, every kept position's hidden state, or None where the model changed its logits after the head) of a
    forward whose LM head sees one row of its input only (no [tokens × vocab] logits are made): the first training
    forward shows whether the chunked loss may take the head's input in place of the model's logits."""
    kept, seen = [], []

    def one_row(module, args):  # keep every kept position's hidden state; the head sees the first row only
        kept.append(args[0])
        return (args[0].narrow(-2, 0, 1), *args[1:])

    narrow = head.register_forward_pre_hook(one_row)
    record = head.register_forward_hook(lambda m, args, output: seen.append(output))
    try:
        outputs = model(**forward)
    finally:
        narrow.remove()
        record.remove()
    unchanged = len(seen) == 1 and returned_unchanged(logits_of(outputs), seen[0])
    return outputs, kept[0] if unchanged else None
