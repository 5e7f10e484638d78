"""scripts/bench_vlm.py --quick: one JSON with padded, token_budget and packed, each with sane throughput and memory
figures (the speed target itself is the benchmark's, never a test's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the VLM benchmark's quick run: each mode a process of its own
@pytest.mark.subprocess
def test_bench_vlm_quick_writes_the_three_modes(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_vlm.py", "--quick", "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {"padded", "token_budget", "packed"} <= set(results)
    for mode in ("padded", "token_budget", "packed"):
        r = results[mode]
        assert r["rows"] > 0 and r["real_tokens"] > 10 * r["rows"]  # image tokens and a caption per row
        assert r["seconds"] > 0
        assert r["samples_per_s"] == pytest.approx(r["rows"] / r["seconds"])
        assert r["real_tokens_per_s"] == pytest.approx(r["real_tokens"] / r["seconds"])
        assert 100 < r["peak_mem_mb"] < 64 * 1024  # a 135M model in float32 with its optimizer: hundreds of MB at least
    # every mode trains the same rows' kind: tokens per row agree within the spread of caption lengths
    per_row = [results[m]["real_tokens"] / results[m]["rows"] for m in ("padded", "token_budget", "packed")]
    assert max(per_row) < 3 * min(per_row)
    assert "packed" in result.stdout and "vs padded" in result.stdout


def test_a_packed_multimodal_rope_row_counts_its_sequences_once():
    """Packed Qwen-VL rows carry [4, B, L] position_ids (the text row over three rope rows, each 0 at a sequence's
    start): the benchmark counts the sequences from the text row, not four times over (the H200 run of 2026-11-26
    counted 1,536 rows for 384)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("bench_vlm", ROOT / "scripts" / "bench_vlm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    meter = bench.Throughput()
    meter.timing = True
    text = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    rope = torch.stack([text, torch.zeros_like(text), torch.zeros_like(text)])  # image tokens: many zeros
    module = torch.nn.Linear(1, 1).train()
    meter.hook(module, (), {"input_ids": torch.ones_like(text), "position_ids": torch.cat([text[None], rope])})
    meter.hook(module, (), {"input_ids": torch.ones_like(text), "position_ids": text})
    assert (meter.rows, meter.tokens) == (6, 18)
