"""TokenNormGRPOTrainer against TRL's GRPOTrainer and the float64 brute force of each window's GRPO objective: a tiny
Llama over a word vocabulary, 16 prompts of a few words, 4 completions of ≤ 8 tokens each, a deterministic reward,
SGD; every optimizer step's applied gradient (captured before the step) is compared with the gradient of the
objective of the micro-batches that window really held (its completions, advantages, old and reference
log-probabilities fixed), one sequence at a time in float64 (finetune/rl/grpo_reference.py). GRPOTrainer's own
deviation in each cell is printed (`-s`), not asserted."""

import dataclasses
import logging

import pytest
import torch

trl = pytest.importorskip("trl")  # dev extras: make install has it
from transformers import LlamaForCausalLM  # noqa: E402

from finetune import TokenNormGRPOTrainer  # noqa: E402
from finetune.rl.grpo_check import check_grpo  # noqa: E402
from finetune.rl.grpo_reference import Objective, window_objective_gradient  # noqa: E402
from finetune.rl.grpo_toy import (  # noqa: E402
    count_reward,
    prompts,
    sgd_config,
    step_errors,
    tiny_policy_folder,
    train_grpo,
    word_tokenizer,
)
from finetune.testing.reference import relative_error  # noqa: E402
from finetune.testing.toy import model_at  # noqa: E402
from tests.launch import forked_ranks  # noqa: E402
from tests.workers import grpo_worker  # noqa: E402

BOUND = 1e-5  # float32 training against float64: 1.4e-7 to 4.5e-7 measured in every cell below


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy_folder(tmp_path_factory.mktemp("grpo") / "policy")


def test_one_generation_per_window_trains_dapo_exactly_as_grpo_trainer(policy, tmp_path):
    # steps_per_generation == accumulation, one iteration: TRL's generation batch is the window, its dapo exact
    runs = [train_grpo(cls, policy, sgd_config(tmp_path, 2, 2)) for cls in (trl.GRPOTrainer, TokenNormGRPOTrainer)]
    (trl_trainer, trl_steps), (ours, our_steps) = runs
    assert [b["completion_ids"].tolist() for b in ours.seen] == [b["completion_ids"].tolist() for b in trl_trainer.seen]
    for theirs, mine in zip(trl_steps.grads, our_steps.grads, strict=True):
        assert relative_error(mine, theirs) <= 1e-7
    assert len(our_steps.grads) == 2


# (loss type, accumulation, steps_per_generation, num_iterations, beta, more GRPOConfig)
CELLS = {
    f"{loss}-{shape}-beta{beta}": (loss, acc, spg, iterations, beta, {})
    for loss in ("dapo", "bnpo", "grpo")
    for shape, (acc, spg, iterations) in {"gen2x": (2, 4, 1), "iter2": (2, 2, 2)}.items()
    for beta in (0.0, 0.04)
}
CELLS |= {
    "dapo-gen-half": ("dapo", 2, 1, 1, 0.0, {}),  # a window spans two generation batches: generated before it runs
    "dapo-acc3-gen2": ("dapo", 3, 2, 1, 0.04, {}),  # windows straddle generation batches
    "dapo-gen2x-iter2": ("dapo", 2, 4, 2, 0.0, {}),
    "cispo-gen2x": ("cispo", 2, 4, 1, 0.0, {}),
    "sapo-gen2x": ("sapo", 2, 4, 1, 0.0, {}),
    "dapo-gen2x-entropy": ("dapo", 2, 4, 1, 0.0, {"entropy_coef": 0.05}),
    "grpo-gen-half-entropy": ("grpo", 2, 1, 1, 0.0, {"entropy_coef": 0.05}),
    "dapo-gen2x-masked-truncations": ("dapo", 2, 4, 1, 0.0, {"mask_truncated_completions": True}),
}


@pytest.mark.parametrize("cell", list(CELLS.values()), ids=list(CELLS))
def test_every_window_applies_the_gradient_of_its_own_objective(cell, policy, tmp_path, capsys):
    loss_type, acc, spg, iterations, beta, extra = cell
    errors = {}
    for cls in (trl.GRPOTrainer, TokenNormGRPOTrainer):
        args = sgd_config(tmp_path, acc, spg, num_iterations=iterations, beta=beta, loss_type=loss_type, **extra)
        trainer, steps = train_grpo(cls, policy, args)
        errors[cls] = step_errors(trainer, steps, policy)
    with capsys.disabled():
        trl_error, ours = max(errors[trl.GRPOTrainer]), max(errors[TokenNormGRPOTrainer])
        print(f"\n{loss_type} acc={acc} spg={spg} iterations={iterations} beta={beta} {extra}: ", end="")
        print(f"GRPOTrainer {trl_error:.2e}, TokenNormGRPOTrainer {ours:.2e}")
    assert len(errors[TokenNormGRPOTrainer]) == 2 and max(errors[TokenNormGRPOTrainer]) <= BOUND


def test_the_brute_force_tells_one_normalization_from_another(policy, tmp_path):
    # the same applied gradients against the per-sequence objective (grpo's) instead of dapo's: far off
    trainer, steps = train_grpo(TokenNormGRPOTrainer, policy, sgd_config(tmp_path, 2, 4))
    initial, objective = LlamaForCausalLM.from_pretrained(policy), Objective.of(trainer.args)
    assert max(step_errors(trainer, steps, policy)) <= BOUND
    wrong = dataclasses.replace(objective, loss_type="grpo")
    reference = window_objective_gradient(model_at(initial, steps.before[0]), trainer.seen[:2], wrong)
    assert relative_error(steps.grads[0], reference) > 1e-2


def test_the_adaptive_entropy_bonus_is_the_window_mean_at_the_coefficient_trl_applies(policy, tmp_path):
    # entropy stays below the target, so TRL's controller raises the coefficient by delta after every step; the first
    # window applies none (its last measured entropy starts at infinity)
    args = sgd_config(
        tmp_path, 2, 4, max_steps=3, use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.005,
        entropy_target=100.0,
    )  # fmt: skip
    trainer, steps = train_grpo(TokenNormGRPOTrainer, policy, args)
    initial, objective = LlamaForCausalLM.from_pretrained(policy), Objective.of(args)
    for k, coefficient in enumerate((0.0, 0.055, 0.06)):
        at = dataclasses.replace(objective, entropy_coef=coefficient)
        reference = window_objective_gradient(model_at(initial, steps.before[k]), trainer.seen[2 * k : 2 * k + 2], at)
        assert relative_error(steps.grads[k], reference) <= BOUND


def test_a_window_without_loss_tokens_makes_no_update_where_adamw_would_decay(policy, tmp_path, caplog):
    # every completion runs to the length limit without EOS (nor pad), and truncated completions are masked
    args = sgd_config(
        tmp_path, 2, 2, max_steps=1, mask_truncated_completions=True, optim="adamw_torch", weight_decay=0.1,
        learning_rate=0.01, generation_kwargs={"min_new_tokens": 8, "suppress_tokens": [0]},
    )  # fmt: skip
    moved = {}
    for cls in (trl.GRPOTrainer, TokenNormGRPOTrainer):
        with caplog.at_level(logging.WARNING):
            trainer, steps = train_grpo(cls, policy, args)
        assert sum(int(b["completion_mask"].sum()) for b in trainer.seen) == 0
        moved[cls] = max(
            float((p.detach() - steps.before[0][n]).abs().max()) for n, p in trainer.model.named_parameters()
        )
    assert moved[trl.GRPOTrainer] > 1e-5 and moved[TokenNormGRPOTrainer] == 0.0
    assert "optimizer step 1: the window has no loss-mask token on any rank" in caplog.text


def test_the_bonus_over_high_entropy_tokens_says_it_stays_trls(policy, tmp_path, caplog):
    args = sgd_config(tmp_path, 2, 4, max_steps=1, entropy_coef=0.05, top_entropy_quantile=0.5)
    with caplog.at_level(logging.WARNING):
        train_grpo(TokenNormGRPOTrainer, policy, args)
    assert caplog.text.count("the entropy bonus over the high-entropy tokens (top_entropy_quantile=0.5)") == 1


@pytest.mark.distributed
@pytest.mark.parametrize("loss_type, trainers", [("dapo", ("trl", "ours")), ("bnpo", ("ours",))])
def test_two_ranks_divide_each_window_by_its_tokens_on_both(loss_type, trainers, policy, tmp_path, capsys):
    # each rank's micro-batches hold other completions (uneven token counts); DDP averages the two ranks' gradients.
    # GRPOTrainer's deviation is measured once (dapo), each forked pair costs ~7 s
    initial, objective = (
        LlamaForCausalLM.from_pretrained(policy),
        Objective(loss_type=loss_type, max_completion_length=8),
    )
    errors = {}
    for name in trainers:
        out = str(tmp_path / name)
        forked_ranks(grpo_worker.main, out, str(policy), name, loss_type, 2, 4)
        ranks = [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(2)]
        assert relative_error(ranks[1]["grads"][0], ranks[0]["grads"][0]) <= 1e-7  # averaged: the same on both
        tokens = [int(sum(b["completion_mask"].sum() for b in rank["seen"][:2])) for rank in ranks]
        assert tokens[0] != tokens[1], "the test needs uneven token counts per rank"
        errors[name] = []
        for k, grads in enumerate(ranks[0]["grads"]):
            window = [b for rank in ranks for b in rank["seen"][2 * k : 2 * k + 2]]
            reference = window_objective_gradient(model_at(initial, ranks[0]["before"][k]), window, objective)
            errors[name].append(relative_error(grads, reference))
    with capsys.disabled():
        measured = ", ".join(f"{name} {max(found):.2e}" for name, found in errors.items())
        print(f"\n{loss_type} 2 ranks acc=2 spg=4: {measured}")
    assert len(errors["ours"]) == 2 and max(errors["ours"]) <= BOUND


class DividedTwice(TokenNormGRPOTrainer):
    """A normalization bug the check must catch: every micro-batch's loss halved once more."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        return super().compute_loss(model, inputs, *args, **kwargs) / 2


def test_check_grpo_passes_an_exact_trainer_and_fails_a_halved_one_with_clipping(policy, tmp_path):
    args = sgd_config(tmp_path, 2, 4, max_grad_norm=0.5, learning_rate=0.1)
    exact = check_grpo(TokenNormGRPOTrainer, str(policy), count_reward, args, prompts(), word_tokenizer(), steps=2)
    assert [c.step for c in exact] == [1, 2] and all(c.passed and c.loss_tokens > 0 for c in exact)
    args = sgd_config(tmp_path, 2, 4, max_grad_norm=0.0)
    halved = check_grpo(DividedTwice, str(policy), count_reward, args, prompts(), word_tokenizer())
    assert len(halved) == 1 and not halved[0].passed and halved[0].relative_error == pytest.approx(0.5, rel=1e-3)


def test_check_grpo_refuses_what_the_brute_force_does_not_write_out(policy, tmp_path):
    args = sgd_config(tmp_path, 2, 4, top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match=r"^check_grpo: top_entropy_quantile=0.5 is not written out"):
        check_grpo(TokenNormGRPOTrainer, str(policy), count_reward, args, prompts(), word_tokenizer())
