"""Run under torchrun on 2 CPU ranks (gloo), or forked by tests.launch.forked_ranks: LAMB and LARS on FSDP2-sharded
layers against the same model unsharded; rank 0 writes {optimizer: largest parameter difference} as JSON for
tests/test_optim.py."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from finetune.env import exit_process
from finetune.recipe import OptimConfig
from finetune.training.optim import build_optimizer


def run(model, name):
    optimizer = build_optimizer(model, OptimConfig(name=name, weight_decay=0.01, trust_coefficient=0.02), 0.05)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)  # the same batch on every rank
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    errors = {}
    for name in ("lamb", "lars"):
        plain, sharded = run(make(), name), make()
        for layer in sharded:
            fully_shard(layer)
        fully_shard(sharded)
        got = run(sharded, name)
        errors[name] = max((got[n] - plain[n]).abs().max().item() for n in plain)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            f.write(json.dumps(errors))
    dist.barrier()  # leave together: a rank whose peer has gone can abort in gloo's teardown
    # no destroy_process_group: freeing the group right after a gloo collective can deadlock (finetune.env.exit_process)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # no object teardown: see finetune.env.exit_process
