"""DDP on 2 CPU ranks, each with the environment `accelerate launch --config_file accelerate_configs/ddp.yaml` gives it:
gradients are all-reduced exactly once per optimizer step under accumulation, and after every micro-batch with
train.sync_each_batch; both give the same run.
"""

from pathlib import Path

import pytest
import torch

from tests.launch import forked_ranks
from tests.workers import sync_count_worker

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed  # two gloo ranks, forked
STEPS, ACCUMULATION = 2, 3
# debug recipe, micro-batch 4 on 2 ranks: global 24 → 3 micro-batches per rank per optimizer step
RECIPE = [
    f"recipe={ROOT / 'recipes' / 'debug.yaml'}",
    f"train.max_steps={STEPS}",
    "train.global_batch_size=24",
    "optim.name=sgd",
    "optim.lr=0.5",
]
# what `accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2` adds to a rank's environment
# (with ACCELERATE_USE_CPU=true: DDP on gloo); forked_ranks sets the torchrun part (RANK, WORLD_SIZE, MASTER_*)
DDP_LAUNCH = {
    "ACCELERATE_USE_CPU": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync") / "counts.pt"
    forked_ranks(sync_count_worker.main, str(out), *RECIPE, f"train.output_dir={out.parent / 'run'}", **DDP_LAUNCH)
    return torch.load(out, weights_only=False)


def syncing_micro_batches(run) -> list[int]:
    """The micro-batches (1-based, in training order) whose backward all-reduced gradients."""
    return sorted(set(run["gradient_syncs"]))


def test_ddp_reduces_gradients_once_per_optimizer_step(runs):
    run = runs["false"]
    assert (run["world_size"], run["accumulation"], run["steps"]) == (2, ACCUMULATION, STEPS)
    assert run["micro_batches"] == STEPS * ACCUMULATION
    # only the last micro-batch of each window communicates: 3 and 6
    assert syncing_micro_batches(run) == [ACCUMULATION * (s + 1) for s in range(STEPS)]
    buckets = len(run["gradient_syncs"]) // STEPS
    assert buckets >= 1 and len(run["gradient_syncs"]) == STEPS * buckets


def test_sync_each_batch_reduces_after_every_micro_batch(runs):
    once, each = runs["false"], runs["true"]
    assert syncing_micro_batches(each) == list(range(1, STEPS * ACCUMULATION + 1))
    buckets = len(once["gradient_syncs"]) // STEPS
    assert len(each["gradient_syncs"]) == STEPS * ACCUMULATION * buckets
    # same data, same updates: syncing more often changes when gradients are averaged, not what is applied
    assert each["losses"] == pytest.approx(once["losses"], rel=1e-6)
    for name, weight in once["weights"].items():
        torch.testing.assert_close(each["weights"][name], weight, rtol=1e-5, atol=1e-7)


def test_label_tokens_are_all_reduced_once_per_window(runs):
    for run in runs.values():
        # per optimizer step: one int64 all-reduce of the window's counts (label tokens first) before its first
        # backward, and one int32 all-reduce of the step's flags (non-finite loss, non-finite gradients, stop request)
        # after its last; no float all-reduce outside DDP's gradient buckets (none inside the loss)
        expected = []
        for s in range(STEPS):
            expected += [(ACCUMULATION * s, "torch.int64"), (ACCUMULATION * (s + 1), "torch.int32")]
        assert run["other_all_reduces"] == expected
