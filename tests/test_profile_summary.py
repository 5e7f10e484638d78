"""scripts/profile_summary.py on a real CPU trace at toy size (top-level CPU ops stand in for kernels: a CPU trace has
none) and on a CUDA-shaped trace written here with known kernels, gaps and syncs."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from profile_summary import markdown, summarize  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


def test_a_real_cpu_trace_is_summarised_from_its_top_level_ops(tmp_path):
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            y = x @ x
            y.sum().item()  # a host read: aten::item → aten::_local_scalar_dense
    profiler.export_chrome_trace(str(tmp_path / "trace.json"))
    summary = summarize(json.loads((tmp_path / "trace.json").read_text()), steps=3, micro_batches=1)
    assert summary["kind"] == "cpu"
    calls = {t["name"]: t["calls"] for t in summary["top"]}
    assert calls["aten::matmul"] == 3 and calls["aten::item"] == 3 and calls["aten::sum"] == 3
    assert summary["host_syncs"]["counts"]["aten::_local_scalar_dense"] == 3  # nested in aten::item, still counted
    assert (
        summary["host_syncs"]["syncing_ops_per_step"] == 1.0 and summary["host_syncs"]["blocking_calls_per_step"] == 0
    )
    totals = [t["total_us"] for t in summary["top"]]
    assert totals == sorted(totals, reverse=True) and abs(sum(t["share"] for t in summary["top"]) - 1) < 1e-3
    idle = summary["idle"]  # top-level ops do not overlap: busy + idle is the span
    assert abs(summary["busy_us"] + idle["idle_us"] - idle["span_us"]) < 0.01  # each rounded to 1 ns
    assert 0 < idle["gaps"] < summary["events"] and idle["largest"][0]["idle_us"] <= idle["idle_us"]
    assert "aten::matmul" in markdown(summary)


def kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur}


def host(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def test_gaps_and_syncs_of_a_cuda_trace():
    events = [
        kernel("gemm", 100, 50),
        kernel("gemm", 160, 50),  # 10 µs idle
        kernel("softmax", 300, 20),  # 90 µs idle, while the host synchronizes inside aten::item
        kernel("gemm", 320, 30),  # back to back
        kernel("copy", 0, 5, stream=9),  # a quieter stream: not the one summarised
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 9, "ts": 215,
         "dur": 2},
        host("cpu_op", "aten::item", 205, 90),
        host("cpu_op", "aten::_local_scalar_dense", 206, 88),
        host("cuda_runtime", "cudaMemcpyAsync", 207, 3),
        host("cuda_runtime", "cudaStreamSynchronize", 211, 80),
        host("cuda_runtime", "cudaStreamSynchronize", 400, 1),
        host("cuda_runtime", "cudaLaunchKernel", 150, 2),
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 3},
    ]  # fmt: skip
    summary = summarize({"traceEvents": events}, steps=2, micro_batches=2)
    assert summary["kind"] == "cuda" and summary["events"] == 4 and summary["busy_us"] == 150
    assert summary["top"][0] == {"name": "gemm", "total_us": 130, "calls": 3, "share": round(130 / 150, 4)}
    idle = summary["idle"]
    assert (idle["span_us"], idle["idle_us"], idle["gaps"], idle["idle_share"]) == (250, 100, 2, 0.4)
    first = idle["largest"][0]
    assert (first["idle_us"], first["at_us"], first["after"], first["before"]) == (90, 110, "gemm", "softmax")
    # innermost first: the sync call inside the scalar read inside aten::item (the 2 µs launch covers too little)
    assert first["host"] == ["cudaStreamSynchronize", "aten::_local_scalar_dense", "aten::item"]
    syncs = summary["host_syncs"]
    assert syncs["counts"]["cudaStreamSynchronize"] == 2 and syncs["counts"]["Memcpy DtoH"] == 1
    assert syncs["blocking_calls_per_step"] == 1.0 and syncs["dtoh_copies_per_step"] == 0.5
    assert syncs["per_micro_batch"]["cudaStreamSynchronize"] == 0.5
    assert "| 0.09 | 0.1 | `gemm` | `softmax` |" in markdown(summary)
