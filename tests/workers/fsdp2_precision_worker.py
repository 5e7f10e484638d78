"""Run under `torchrun --standalone --nproc_per_node 2`: FSDP2 under bf16 on 2 CPU ranks (gloo), one accumulation
window of K micro-batches with gradient sync on the last only, under accelerate's default policy (bf16 gradients
accumulated and reduced) and under the policy `finetune.training.distributed.reduce_in_fp32` makes of it. Rank 0 saves
each window's gradient (full tensors), the float64 reference and the bf16 micro-batch gradients summed in
float64 for tests/test_mixed_precision.py."""

import sys

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import fully_shard

from finetune.env import exit_process
from finetune.training.distributed import reduce_in_fp32

MICRO_BATCHES, WIDTH = 16, 64


def model_and_batches(rank: int, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))
    batches = [
        torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * r + k))
        for r in range(dist.get_world_size())
        for k in range(MICRO_BATCHES)
    ]
    return model.to(dtype), batches[rank * MICRO_BATCHES : (rank + 1) * MICRO_BATCHES], batches


def window_gradient(policy) -> dict:
    model, mine, _ = model_and_batches(dist.get_rank())
    fully_shard(model, mp_policy=policy)
    for k, batch in enumerate(mine):
        model.set_requires_gradient_sync(k == len(mine) - 1)  # no_sync until the window's last micro-batch
        model(batch).float().pow(2).mean().backward()
    return {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}


def reference(dtype) -> dict:
    """The window's gradient, averaged over the ranks as FSDP does, each micro-batch's gradient computed by a `dtype`
    model (bf16: what FSDP2's param_dtype computes) and summed in float64."""
    model, _, every = model_and_batches(0, dtype)
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    for batch in every:
        model.zero_grad()
        model(batch.to(dtype)).float().pow(2).mean().backward()
        for n, p in model.named_parameters():
            total[n] += p.grad.double()
    return {n: g / dist.get_world_size() for n, g in total.items()}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what accelerate gives a bf16 run
    results = {
        "default": window_gradient(plugin.mixed_precision_policy),
        "default_reduce_dtype": str(plugin.mixed_precision_policy.reduce_dtype),
    }
    reduce_in_fp32(plugin)
    results["fp32_reduce"] = window_gradient(plugin.mixed_precision_policy)
    results["fp32_reduce_dtype"] = str(plugin.mixed_precision_policy.reduce_dtype)
    results["param_dtype"] = str(plugin.mixed_precision_policy.param_dtype)
    results["reference"] = reference(torch.float64)
    results["bf16_summed_in_float64"] = reference(torch.bfloat16)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    # no destroy_process_group: freeing the group right after a gloo collective can deadlock (finetune.env.exit_process)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # no object teardown: see finetune.env.exit_process
