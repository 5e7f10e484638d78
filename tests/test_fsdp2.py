"""FSDP2 (`fully_shard`, 2 CPU ranks on gloo) keeps the window's token normalization and the global-norm clip exact.

One run of tests/workers/fsdp2_worker.py runs four one-window trainings on the same 12 ragged rows, uneven label
tokens per rank: by hand through torch, and through TokenNormTrainer on a model sharded at load time by transformers;
each with gradients reduced once per window and after every micro-batch (train.sync_each_batch). Every applied update
(SGD, lr 1) must equal the clipped float64 token-mean gradient of the whole window, computed one sequence at a time."""

import pytest
import torch

from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import ragged_rows, tiny_llama
from tests.launch import forked_ranks
from tests.workers import fsdp2_worker

pytestmark = pytest.mark.distributed  # two gloo ranks, forked
ROWS, SEED = 12, 21  # 2 ranks × 3 micro-batches × 2 rows: one window holds every row
MAX_NORM = 0.25  # well below the window's gradient norm (~0.9), so the clip is active


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    tiny_llama().save_pretrained(tmp / "tiny")  # the trainer path loads it sharded; same weights as tiny_llama()
    out = tmp / "results.pt"
    forked_ranks(fsdp2_worker.main, str(out), str(tmp / "tiny"), ROWS, SEED, MAX_NORM)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference():
    grads, loss = reference_gradient(tiny_llama(), ragged_rows(ROWS, SEED))
    norm = sum(float((g**2).sum()) for g in grads.values()) ** 0.5
    assert norm > 2 * MAX_NORM
    scale = MAX_NORM / (norm + 1e-6)  # torch's clip_grad_norm_ coefficient
    return {n: g * scale for n, g in grads.items()}, loss, norm


@pytest.mark.parametrize("path", ["torch", "trainer"])
@pytest.mark.parametrize("sync_each_batch", [False, True], ids=["sync_once", "sync_each_batch"])
def test_fsdp2_update_is_the_clipped_window_token_mean(runs, reference, path, sync_each_batch):
    clipped, ref_loss, ref_norm = reference
    run = runs[(path, sync_each_batch)]
    tokens = run["rank_tokens"]
    assert tokens[0] != tokens[1], "the test needs uneven label tokens per rank"
    assert relative_error(run["update"], clipped) <= 1e-5
    assert run["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)  # the pre-clip norm over all shards
    assert run["loss"] == pytest.approx(ref_loss, rel=1e-5)
    if path == "torch":
        assert run["grads_are_dtensors"]
    else:
        assert run["sharded"] and run["sync_each_batch"] is sync_each_batch
        assert run["window_label_tokens"] == sum(tokens)
