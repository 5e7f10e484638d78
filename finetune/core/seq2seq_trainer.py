"""`TokenNormSeq2SeqTrainer`: `transformers.Seq2SeqTrainer` with `TokenNormTrainer`'s exact training and eval loss.

Everything of `Seq2SeqTrainer` stays (`predict_with_generate`, `generation_max_length`, `generation_num_beams`,
`generation_config`, `evaluate(**gen_kwargs)`); what changes is where the eval loss of a generating step comes from:
`Seq2SeqTrainer.prediction_step` calls the model itself after `generate` and returns that batch's mean, which
`TokenNormTrainer` cannot see. Here that one forward goes through `compute_loss`, so the whole set's token sums are
gathered as in every other evaluation: still `generate` plus one forward per eval batch.
"""

from __future__ import annotations

import torch
from transformers import Seq2SeqTrainer

from finetune.core.trainer import TokenNormTrainer


class TokenNormSeq2SeqTrainer(TokenNormTrainer, Seq2SeqTrainer):
    """`Seq2SeqTrainer` whose gradient and `eval_loss` are exact token means (see `TokenNormTrainer`)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        generating = self.args.predict_with_generate and not prediction_loss_only
        if not generating or self.loss_kind is None or inputs.get("labels") is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        # Seq2SeqTrainer generates from the inputs without labels (it then runs no loss forward of its own); decoder
        # inputs a collator made from the labels go too, as Seq2SeqTrainer evicts them, or generation would continue
        # from them.
        made_from_labels = inputs.get("decoder_input_ids") is not None and (
            inputs["decoder_input_ids"].shape == inputs["labels"].shape
        )
        evicted = ("labels", "decoder_input_ids", "decoder_attention_mask") if made_from_labels else ("labels",)
        unlabelled = {k: v for k, v in inputs.items() if k not in evicted}
        _, generated, _ = Seq2SeqTrainer.prediction_step(self, model, unlabelled, False, ignore_keys, **gen_kwargs)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).detach()
        if self.args.prediction_loss_only:
            return loss, None, None
        return loss, generated, self._labels_as_long_as_generations(inputs["labels"])

    def _labels_as_long_as_generations(self, labels: torch.Tensor) -> torch.Tensor:
        # Seq2SeqTrainer's padding of the labels, so that metrics see the same arrays.
        config = self.model.generation_config
        if labels.shape[-1] < config.max_length:
            return self._pad_tensors_to_max_len(labels, config.max_length)
        if config.max_new_tokens is not None and labels.shape[-1] < config.max_new_tokens + 1:
            return self._pad_tensors_to_max_len(labels, config.max_new_tokens + 1)
        return labels
