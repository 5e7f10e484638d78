"""LAMB and LARS against plain float64 per-parameter references of the papers' update rules; groups; resume."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from finetune.recipe import OptimConfig
from finetune.training.optim import LAMB, LARS, build_optimizer

BETAS, EPS, DECAY, TRUST = (0.9, 0.99), 1e-6, 0.01, 0.02


class Net(nn.Module):
    """Linear layers with biases, a LayerNorm and a zero-initialized weight (whose trust ratio must fall back to 1)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)
        self.extra = nn.Linear(6, 3, bias=False)
        nn.init.zeros_(self.extra.weight)  # like LoRA's B matrix

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x)))) + self.extra(x)


def batch(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.sin(x[:, :3] * 2).to(dtype)


def loss_of(params_by_name, step, dtype):
    """The net's regression loss as a function of explicit tensors (the reference owns plain tensors, not modules)."""
    p = params_by_name
    x, y = batch(step, dtype)
    h = torch.nn.functional.layer_norm(x @ p["inp.weight"].T + p["inp.bias"], (8,), p["norm.weight"], p["norm.bias"])
    return ((torch.tanh(h) @ p["out.weight"].T + p["out.bias"] + x @ p["extra.weight"].T - y) ** 2).mean()


def exempt(name):
    # what the papers exclude and what is customary: biases and normalization weights
    return name.endswith("bias") or name.startswith("norm.")


def lr_at(step):
    # a changing LR, so where the LR enters (LARS: inside the momentum buffer) matters
    return 0.05 * (1.0 + 0.5 * math.sin(step))


def reference_run(name, model, steps, momentum=0.9):
    """Per parameter, one at a time, float64, written from the papers (LAMB: Alg. 2, φ = identity; LARS: Alg. 1)."""
    w = {n: p.detach().to(torch.float64).clone() for n, p in model.named_parameters()}
    state = {n: {"m": torch.zeros_like(t), "v": torch.zeros_like(t)} for n, t in w.items()}
    for step in range(steps):
        leaves = {n: t.clone().requires_grad_() for n, t in w.items()}
        loss_of(leaves, step, torch.float64).backward()
        lr, t = lr_at(step), step + 1
        for n in w:
            g, s, decay = leaves[n].grad, state[n], 0.0 if exempt(n) else DECAY
            if name == "lamb":
                s["m"] = BETAS[0] * s["m"] + (1 - BETAS[0]) * g
                s["v"] = BETAS[1] * s["v"] + (1 - BETAS[1]) * g * g
                m_hat, v_hat = s["m"] / (1 - BETAS[0] ** t), s["v"] / (1 - BETAS[1] ** t)
                u = m_hat / (v_hat.sqrt() + EPS) + decay * w[n]
                w_norm, u_norm = w[n].norm().item(), u.norm().item()
                ratio = w_norm / u_norm if not exempt(n) and w_norm > 0 and u_norm > 0 else 1.0
                w[n] = w[n] - lr * ratio * u
            else:
                w_norm, g_norm = w[n].norm().item(), g.norm().item()
                local = TRUST * w_norm / (g_norm + decay * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
                if exempt(n):
                    local = 1.0
                s["m"] = momentum * s["m"] + lr * local * (g + decay * w[n])
                w[n] = w[n] - s["m"]
    return w


def our_optimizer(name, model, momentum=0.9):
    cfg = OptimConfig(
        name=name, betas=list(BETAS), eps=EPS, weight_decay=DECAY, momentum=momentum, trust_coefficient=TRUST
    )
    return build_optimizer(model, cfg, lr_at(0))


def our_run(name, model, steps, optimizer=None, start=0, momentum=0.9):
    dtype = next(model.parameters()).dtype
    optimizer = optimizer or our_optimizer(name, model, momentum)
    for step in range(start, start + steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad()
        loss_of(dict(model.named_parameters()), step, dtype).backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("name,momentum", [("lamb", 0.9), ("lars", 0.9), ("lars", 0.0)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_matches_the_papers_update_rule_for_20_steps(name, momentum, dtype, tol):
    torch.manual_seed(0)
    model = Net().to(dtype)
    initial = copy.deepcopy(model)
    optimizer = our_run(name, model, 20, momentum=momentum)
    assert type(optimizer) is {"lamb": LAMB, "lars": LARS}[name]
    groups = {g["trust_ratio"]: g for g in optimizer.param_groups}
    assert groups[False]["weight_decay"] == 0 and groups[True]["weight_decay"] == DECAY
    expected = reference_run(name, initial, 20, momentum)
    moved = 0.0
    for n, p in model.named_parameters():
        scale = expected[n].abs().max().item()
        error = (p.detach().to(torch.float64) - expected[n]).abs().max().item()
        assert error <= tol * max(scale, 1e-3), (n, error, scale)
        moved = max(moved, (expected[n] - initial.get_parameter(n).detach().to(torch.float64)).abs().max().item())
    assert moved > 1e-3  # the comparison is not between two unmoved models
    assert model.extra.weight.abs().max() > 0  # the zero-initialized weight moved (trust ratio 1 at norm 0)


@pytest.mark.parametrize("name,lr", [("lamb", 0.02), ("lars", 2.0)])
def test_reduces_the_loss_on_a_regression(name, lr):
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 4) + 0.5
    model = nn.Linear(16, 4)
    optimizer = build_optimizer(model, OptimConfig(name=name, weight_decay=1e-4, trust_coefficient=0.02), lr)
    losses = []
    for _ in range(150):
        loss = ((model(x) - y) ** 2).mean()
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.02 * losses[0], losses[::25]


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_state_dict_round_trip_resumes_bitwise(name):
    """10 steps, save through torch.save/torch.load(weights_only=True) as the Trainer does, 10 more == 20 at once."""
    torch.manual_seed(0)
    straight = Net()
    resumed = copy.deepcopy(straight)
    our_run(name, straight, 20)

    first = our_run(name, resumed, 10)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    restored = copy.deepcopy(resumed)  # a fresh process would rebuild the model from the checkpoint's weights
    second = our_optimizer(name, restored)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(torch.equal(second.state[p]["step"], torch.tensor(10.0)) for p in restored.parameters())
    our_run(name, restored, 10, optimizer=second, start=10)
    for (n, a), b in zip(straight.named_parameters(), restored.parameters()):
        assert torch.equal(a, b), n


def test_parameters_without_gradients_are_left_alone():
    model = Net()
    model.extra.weight.requires_grad_(False)
    optimizer = build_optimizer(model, OptimConfig(name="lamb"), 0.1)
    before = model.norm.weight.detach().clone()
    loss_of(dict(model.named_parameters()), 0, torch.float32).backward()
    model.norm.weight.grad = None
    optimizer.step()
    assert torch.equal(model.norm.weight, before) and model.norm.weight not in optimizer.state
    assert all(not any(p is model.extra.weight for p in g["params"]) for g in optimizer.param_groups)


@pytest.mark.parametrize("name,cls", [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)])
def test_torch_optimizers_get_the_same_groups(name, cls):
    optimizer = build_optimizer(Net(), OptimConfig(name=name, weight_decay=0.1), 1e-3)
    assert type(optimizer) is cls and optimizer.defaults["foreach"] is True  # CPU: foreach
    decays = sorted((g["weight_decay"], len(g["params"])) for g in optimizer.param_groups)
    assert decays == [(0.0, 4), (0.1, 3)]  # biases and the LayerNorm: no decay; the three weight matrices: decay


@pytest.mark.distributed
def test_fsdp2_sharded_parameters_get_full_tensor_trust_ratios(tmp_path):
    """Under FSDP2 each rank holds a shard; the norms (foreach over DTensors) must be those of the whole tensor."""
    import json

    from tests.launch import forked_ranks
    from tests.workers import fsdp2_optim_worker

    result = tmp_path / "errors.json"
    forked_ranks(fsdp2_optim_worker.main, str(result))
    errors = json.loads(result.read_text())
    assert errors["lamb"] < 1e-6 and errors["lars"] < 1e-6, errors


def test_the_groups_at_the_recipes_own_lr_come_first_so_the_logged_lr_is_the_recipes():
    """Trainer logs param_groups[0]'s LR as learning_rate: with a 10x head, that group must not be first."""
    from finetune.training.optim import param_groups

    model = Net()
    first_param = next(n for n, _ in model.named_parameters()).split(".")[0]  # the first module in model order
    groups = param_groups(model, OptimConfig(lr_multipliers={first_param: 10.0}), 1e-3)
    assert [g["lr"] for g in groups][0] == 1e-3 and 1e-2 in [g["lr"] for g in groups]
    assert any(n.startswith(first_param) for g in groups if g["lr"] == 1e-2 for n in g["names"])
