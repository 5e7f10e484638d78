"""Loss terms a model's own forward adds to `loss` beside the router balancing loss: Bamba's z-loss (its config's
z_loss_coefficient), or a loss the model returns as a field of its own (Switch Transformers' encoder_z_loss and
decoder_aux_loss). TokenNormTrainer cannot place them in the window's token mean, so it trains exactly as
transformers.Trainer does (which keeps them) with one warning naming them; a recipe refuses them in one line, before
the weights load, naming what to set."""

import copy
import logging
from dataclasses import dataclass

import pytest
import torch
from transformers import BambaConfig, BambaForCausalLM, LlamaForCausalLM, Trainer
from transformers.modeling_outputs import CausalLMOutputWithPast

from finetune import TokenNormTrainer
from finetune.testing.families import family_folder, verify_argv
from finetune.testing.toy import VOCAB, RecordingCollator, ragged_rows, step_errors, tiny_llama, train_recording
from finetune.tools import verify
from tests.data_files import smollm2_folder

Z_LOSS = 0.05


def tiny_bamba(z_loss: float) -> BambaForCausalLM:
    torch.manual_seed(0)
    config = BambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=16,
        max_position_embeddings=64,
        pad_token_id=0,
        z_loss_coefficient=z_loss,
    )
    return BambaForCausalLM(config)


@dataclass
class WithZLoss(CausalLMOutputWithPast):
    z_loss: torch.Tensor | None = None


class ZLossLlama(LlamaForCausalLM):
    """A research model that returns its z-loss beside the logits and, given labels, adds it to its loss."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, labels=labels, **kwargs)
        z_loss = out.logits.float().logsumexp(-1).pow(2).mean()
        loss = None if out.loss is None else out.loss + Z_LOSS * z_loss
        return WithZLoss(loss=loss, logits=out.logits, z_loss=z_loss)


def zloss_llama() -> ZLossLlama:
    base = tiny_llama()
    model = ZLossLlama(base.config)
    model.load_state_dict(base.state_dict())
    return model


def trains_as_trainer(initial, tmp_path, caplog, expected: str) -> None:
    """TokenNormTrainer on `initial` (two windows of two micro-batches) against transformers.Trainer: the same
    weights bitwise, one warning saying which terms made it Trainer's loss."""
    rows = ragged_rows(8, seed=5)
    with caplog.at_level(logging.WARNING, logger="finetune.core.trainer"):
        ours = train_recording(TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path / "ours", 2, 2)
    stock = train_recording(Trainer, copy.deepcopy(initial), rows, tmp_path / "stock", 2, 2, RecordingCollator())
    lines = [r.getMessage() for r in caplog.records if "terms this trainer does not compute" in r.getMessage()]
    assert len(lines) == 1 and expected in lines[0], caplog.text
    assert ours[0].loss_kind is None and len(ours[2]) == len(stock[2]) == 3
    for name, value in stock[2][-1].items():
        torch.testing.assert_close(ours[2][-1][name], value, rtol=0, atol=0, msg=name)


def test_a_z_loss_the_config_turns_on_trains_as_trainer_with_one_warning(tmp_path, caplog):
    trains_as_trainer(tiny_bamba(Z_LOSS), tmp_path, caplog, f"BambaForCausalLM adds z_loss_coefficient={Z_LOSS}")


def test_a_loss_the_model_returns_beside_its_logits_trains_as_trainer_with_one_warning(tmp_path, caplog):
    trains_as_trainer(zloss_llama(), tmp_path, caplog, "ZLossLlama adds z_loss to its loss")


def test_without_the_z_loss_the_same_model_trains_the_exact_token_mean(tmp_path):
    initial = tiny_bamba(0.0)
    _, windows, snapshots = train_recording(TokenNormTrainer, copy.deepcopy(initial), ragged_rows(8, 5), tmp_path, 2, 2)
    errors = [error for error, _ in step_errors(initial, windows, snapshots)]
    assert len(errors) == 2 and max(errors) <= 1e-5, errors


@pytest.mark.e2e
def test_a_recipe_on_a_model_with_a_z_loss_is_one_line_before_the_weights(tmp_path, capsys):
    from transformers import AutoTokenizer

    folder = family_folder(tmp_path, "bamba", AutoTokenizer.from_pretrained(str(smollm2_folder())))
    argv = [*verify_argv(folder, "bamba", "padded"), "model.config_overrides.z_loss_coefficient=0.01"]
    code = verify.main(argv)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and errors == [
        f"error: model.name_or_path={folder}: its config's z_loss_coefficient=0.01 adds a loss term to its forward's "
        "loss that this trainer does not compute (the exact token mean would drop it); set it to 0 in the model "
        "folder's config.json (or model.config_overrides with model.from_config=true) to train without it"
    ], err[-3000:]
    assert "parameters:" not in out
