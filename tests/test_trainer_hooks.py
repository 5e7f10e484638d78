"""The `transformers.Trainer` methods our trainers override, pinned: an upgrade of transformers that changes one's
parameters (a name, its kind, its default) is this test failing with the method's name, not a hook silently called
with other arguments. The pins are the parameters as transformers 5.24 has them; an override's own parameters must
take every one of them."""

from __future__ import annotations

import inspect

import pytest
import transformers

from finetune import TokenNormSeq2SeqTrainer, TokenNormTrainer

PINNED = {  # method: its parameters in Trainer (Seq2SeqTrainer where it defines its own), as `name=default`
    "training_step": "self, model, inputs, num_items_in_batch=None",
    "get_train_dataloader": "self",
    "_prepare_input": "self, data",
    "get_batch_samples": "self, epoch_iterator, num_batches, device",
    "compute_loss": "self, model, inputs, return_outputs=False, num_items_in_batch=None",
    "prediction_step": "self, model, inputs, prediction_loss_only, ignore_keys=None",
    "evaluate": "self, eval_dataset=None, ignore_keys=None, metric_key_prefix='eval'",
    "evaluation_loop": "self, dataloader, description, prediction_loss_only=None, ignore_keys=None, "
    "metric_key_prefix='eval'",
    "create_optimizer": "self, model=None",
    "log": "self, logs, start_time=None",
}
SEQ2SEQ = {
    "prediction_step": "self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs",
    "evaluate": "self, eval_dataset=None, ignore_keys=None, metric_key_prefix='eval', **gen_kwargs",
}


def parameters(function) -> str:
    out = []
    for p in inspect.signature(function).parameters.values():
        name = f"**{p.name}" if p.kind is p.VAR_KEYWORD else f"*{p.name}" if p.kind is p.VAR_POSITIONAL else p.name
        out.append(name if p.default is p.empty else f"{name}={p.default!r}")
    return ", ".join(out)


def overridden(ours: type, base: type) -> set[str]:
    """The methods of `base` that a class of ours in `ours`'s MRO defines again."""
    return {
        name
        for klass in ours.__mro__
        if klass.__module__.startswith("finetune")
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("__") and hasattr(base, name)
    }


@pytest.mark.parametrize(
    "ours, base, pins",
    [
        (TokenNormTrainer, transformers.Trainer, PINNED),
        (TokenNormSeq2SeqTrainer, transformers.Seq2SeqTrainer, {**PINNED, **SEQ2SEQ}),
    ],
    ids=["Trainer", "Seq2SeqTrainer"],
)
def test_every_overridden_trainer_method_is_pinned_to_its_parameters(ours, base, pins):
    names = overridden(ours, base)
    assert names == set(pins), f"overrides not pinned here: {sorted(names - set(pins))}; pinned, no longer: " + str(
        sorted(set(pins) - names)
    )
    changed = {name: parameters(getattr(base, name)) for name in names if parameters(getattr(base, name)) != pins[name]}
    assert not changed, (
        f"transformers {transformers.__version__} changed these methods our trainers override: {changed}"
    )
    for name in names:  # an override takes every argument transformers passes it
        theirs = inspect.signature(getattr(base, name)).parameters
        mine = inspect.signature(getattr(ours, name)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in mine.values())
        missing = [
            p for p in theirs if p not in mine and not (takes_any and theirs[p].kind is not theirs[p].VAR_POSITIONAL)
        ]
        assert not missing, f"{ours.__name__}.{name} does not take {missing}"
