"""Two CPU ranks (gloo) with uneven token counts per rank apply the same update as one process on the full batch."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from finetune import TokenNormTrainer
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import ragged_rows, tiny_llama, train_recording
from tests.launch import ROOT, forked_ranks
from tests.workers import dist_worker


@pytest.mark.distributed
def test_two_ranks_equal_one_process_full_batch(tmp_path):
    micro, accumulation, seed = 2, 3, 21
    rows = micro * accumulation * 2  # one window: every row, split across the two ranks
    out = str(tmp_path / "two_ranks.pt")
    forked_ranks(dist_worker.main, out, micro, accumulation, rows, seed)
    two = torch.load(out, weights_only=True)
    tokens = two["rank_label_tokens"]
    assert tokens[0] != tokens[1], "the test needs uneven token counts per rank"

    initial = tiny_llama()
    data = ragged_rows(rows, seed)
    _, _, one = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), data, tmp_path / "one", micro, accumulation * 2
    )
    grads, ref_loss = reference_gradient(initial, data)
    applied_two = {n: two["snapshots"][0][n] - two["snapshots"][1][n] for n in grads}
    applied_one = {n: one[0][n] - one[1][n] for n in grads}
    assert relative_error(applied_two, grads) <= 1e-5
    assert relative_error(applied_one, grads) <= 1e-5
    assert relative_error(applied_two, applied_one) <= 1e-5
    logged = next(e for e in two["log_history"] if "loss" in e and "train_loss" not in e)
    assert logged["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert logged["window_label_tokens"] == sum(tokens)


@pytest.mark.subprocess  # how exit_process ends a real process: its exit code, exit handlers and interpreter teardown
@pytest.mark.parametrize("world_size, torn_down", [("2", False), ("1", True)])
def test_a_launched_rank_exits_with_its_code_after_the_exit_handlers_and_without_teardown(world_size, torn_down):
    result = subprocess.run(
        [sys.executable, "tests/workers/exit_worker.py", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "WORLD_SIZE": world_size},
        timeout=120,
    )
    assert result.returncode == 3
    assert result.stdout.startswith("unflushed") and "exit handlers ran" in result.stdout
    assert ("torn down" in result.stdout) is torn_down
