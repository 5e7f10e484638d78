"""`packed_sdpa` attends within each packed sequence and computes what one sequence at a time computes."""

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening, LlamaForCausalLM

from finetune import TokenNormTrainer
from finetune.model import packed_attention
from finetune.model.packed_attention import NAME, use_for_packed_rows
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import VOCAB, SnapshotCallback, model_at, ragged_rows, sgd_args, tiny_llama
from tests.attention import RecordingFlattening, alone_logits, rows_with_short_ones, tiny_mha, with_attention

MODELS = {"gqa": tiny_llama, "mha": tiny_mha}


class SdpaCalls:
    """Records the (query length, is_causal, mask given) of every torch sdpa call."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = torch.nn.functional.scaled_dot_product_attention

        def record(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
            self.calls.append((query.shape[-2], is_causal, attn_mask is not None))
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)


@pytest.mark.parametrize("kind", MODELS)
def test_packed_logits_equal_each_sequence_alone(kind, monkeypatch):
    model = with_attention(MODELS[kind](), NAME)
    rows = rows_with_short_ones(seed=2)
    batch = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)([dict(r) for r in rows])
    sdpa = SdpaCalls(monkeypatch)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    assert (packed.double() - alone_logits(model, rows)).abs().max() <= 1e-5
    # it ran per sequence: one causal, unmasked call per sequence and layer, each the sequence's length
    lengths = [len(r["input_ids"]) for r in rows]
    assert sdpa.calls == [(n, True, False) for n in lengths] * model.config.num_hidden_layers


def test_rows_of_a_batch_split_on_their_own_boundaries():
    """Two packed rows in one batch (same length, different splits): each row attends within its own sequences."""
    model = with_attention(tiny_llama(), NAME)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in (6, 2, 9, 1, 8, 8)]
    first, second = rows[:3], rows[3:]  # 17 tokens each
    ids = torch.tensor([sum((r["input_ids"] for r in part), []) for part in (first, second)])
    positions = torch.tensor([sum((list(range(len(r["input_ids"]))) for r in part), []) for part in (first, second)])
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert (packed.flatten(0, 1).double() - alone_logits(model, rows)).abs().max() <= 1e-5


def test_a_padded_batch_keeps_its_mask():
    """Right-padded rows with an attention mask take sdpa's masked path: the same logits as sdpa."""
    model = with_attention(tiny_llama(), NAME)
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = with_attention(copy.deepcopy(model), "sdpa")(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, want)


def test_training_dropout_applies_per_sequence():
    config_model = tiny_llama()
    config_model.config.attention_dropout = 0.5
    model = with_attention(LlamaForCausalLM(config_model.config), NAME)
    model.load_state_dict(config_model.state_dict())
    rows = rows_with_short_ones(seed=5)
    batch = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)([dict(r) for r in rows])
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    model.eval()
    with torch.no_grad():
        exact = model(**inputs).logits
    assert (exact[0].double() - alone_logits(model, rows)).abs().max() <= 1e-5  # eval: no dropout
    model.train()
    torch.manual_seed(0)
    dropped = model(**inputs).logits
    torch.manual_seed(0)
    again = model(**inputs).logits
    assert torch.equal(dropped, again) and (dropped - exact).abs().max() > 1e-2  # seeded, and it did drop
    dropped.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_packed_training_is_exact(tmp_path):
    """TokenNormTrainer on packed rows with packed_sdpa: each window's update is the float64 brute-force gradient."""
    initial = with_attention(tiny_llama(), "eager")  # the reference runs eager, one sequence at a time
    trained = with_attention(copy.deepcopy(initial), NAME)
    collator, snapshots = RecordingFlattening(), SnapshotCallback()
    rows = ragged_rows(10, seed=4) + [{"input_ids": [3], "labels": [3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    trainer = TokenNormTrainer(
        model=trained, args=sgd_args(tmp_path, 3, 2), train_dataset=rows, data_collator=collator, callbacks=[snapshots]
    )
    trainer.train()
    assert trained.config._attn_implementation == NAME
    windows = [collator.batches[0] + collator.batches[1], collator.batches[2] + collator.batches[3]]
    for k, window in enumerate(windows):
        grads, _ = reference_gradient(model_at(initial, snapshots.snapshots[k]), window)
        applied = {n: snapshots.snapshots[k][n] - snapshots.snapshots[k + 1][n] for n in grads}
        assert relative_error(applied, grads) <= 1e-5


def test_switched_on_only_for_sdpa_and_only_where_the_probe_agrees(monkeypatch):
    model = tiny_llama()
    assert (
        "packed_sdpa" in use_for_packed_rows(model, "data.batching=padded")
        and model.config._attn_implementation == NAME
    )
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"
    assert (
        use_for_packed_rows(eager, "data.batching=padded").startswith("attention: eager")
        and eager.config._attn_implementation == "eager"
    )
    # an implementation that let attention cross sequences would be caught by the probe, and sdpa kept
    monkeypatch.setattr(packed_attention, "sequence_bounds", lambda batch, length, kwargs: [[(0, length)]] * batch)
    leaky = tiny_llama()
    line = use_for_packed_rows(leaky, "data.batching=padded")
    assert "differ from sdpa's" in line and leaky.config._attn_implementation == "sdpa"


def test_sliding_window_models_keep_sdpa():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        attn_implementation="sdpa",
    )
    model = MistralForCausalLM(config)
    assert (
        "sliding-window" in use_for_packed_rows(model, "data.batching=padded")
        and model.config._attn_implementation == "sdpa"
    )


def test_build_uses_it_for_packed_batching_only(tmp_path, capsys):
    from finetune.assemble import build
    from finetune.recipe import load_config

    common = ["recipe=recipes/debug.yaml", "data.limit=8", "data.max_length=64", "log.wandb_mode=disabled"]
    for batching, expected in (("packed", NAME), ("padded", "sdpa")):
        cfg = load_config([*common, f"data.batching={batching}", f"train.output_dir={tmp_path / batching}"])
        trainer = build(cfg)
        assert trainer.model.config._attn_implementation == expected
    assert "attention: packed_sdpa" in capsys.readouterr().out


def test_flash_attention_kwargs_give_the_bounds_where_a_collator_returns_them(monkeypatch):
    model = with_attention(tiny_llama(), NAME)
    rows = rows_with_short_ones(seed=7)
    collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100, return_flash_attn_kwargs=True)
    batch = collate([dict(r) for r in rows])
    monkeypatch.setattr(packed_attention, "row_bounds", None)  # the bounds must come from cu_seq_lens_q
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits[0]
    assert (packed.double() - alone_logits(model, rows)).abs().max() <= 1e-5
