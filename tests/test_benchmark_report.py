"""scripts/benchmark.py's arm names and report logic on synthetic results: which arm is the best peer, the ratios to
it, the targets, and "not measured" where an arm did not run. No training here (tests/test_benchmark.py runs it)."""

import importlib

import pytest

from tests.test_benchmark import LIGER_WHY, ROOT


@pytest.fixture
def scripts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the modules import each other by name, as the entry does
    return importlib.import_module("bench_arms"), importlib.import_module("bench_report")


def ran(rate: float, memory: float, share: float = 1.0, **more) -> dict:
    return {"real_tokens_per_s": rate, "peak_mem_mb": memory, "real_token_share": share, **more}


def synthetic() -> dict:
    return {
        "hf_padded": ran(500.0, 2000.0, 0.45),
        "hf_flatten": ran(1000.0, 1200.0),
        "trl_padding_free+flex": ran(1800.0, 1000.0),
        "trl_packing+flex+liger": ran(2500.0, 900.0),
        "trl_packing+flex+liger+bf16w": {"skipped": "failed in its process (exit 1): RuntimeError: boom"},
        "packed": ran(3000.0, 800.0, peak_mem_mb_accumulation_1=760.0),
        "token_budget": ran(4000.0, 700.0, 0.99),
        "packed_after_liger": {"skipped": "Liger's Triton kernels need a CUDA device"},
        "hand_loop": ran(450.0, 2400.0, 0.45),
        "padded": ran(460.0, 1300.0, 0.45),
    }


def test_the_best_peer_is_the_fastest_of_every_trainer_and_trl_arm_that_ran(scripts):
    _, report = scripts
    results = synthetic()
    report.add_ratios(results)
    packed = results["packed"]
    assert (packed["best_hf_arm"], packed["best_trl_arm"]) == ("hf_flatten", "trl_packing+flex+liger")
    assert packed["best_peer_arm"] == "trl_packing+flex+liger"  # a skipped arm is never the best, however named
    assert packed["tokens_per_s_vs_best_peer"] == 3000.0 / 2500.0
    assert packed["peak_mem_vs_best_peer"] == 800.0 / 900.0
    assert packed["tokens_per_s_vs_best_hf"] == 3.0 and packed["peak_mem_vs_best_hf"] == 800.0 / 1200.0
    assert results["hf_padded"]["tokens_per_s_vs_best_trl"] == 500.0 / 2500.0
    assert results["trl_packing+flex+liger"]["tokens_per_s_vs_best_peer"] == 1.0
    assert results["packed_after_liger"] == {"skipped": "Liger's Triton kernels need a CUDA device"}  # untouched


def test_targets_measure_what_ran_and_say_not_measured_otherwise(scripts):
    _, report = scripts
    rows = {name: (passed, measured) for name, passed, measured in report.targets(synthetic(), 4, "0.5b")}
    best = "best peer (trl_packing+flex+liger)"
    assert rows[f"packed ≥ 1.5× {best} real tokens/s"] == (False, "1.20×")
    assert rows[f"token_budget ≥ 1.5× {best} real tokens/s"] == (True, "1.60×")
    assert rows[f"packed peak memory ≤ 0.8× {best}"] == (False, "0.89×")
    assert rows[f"token_budget peak memory ≤ 0.8× {best}"] == (True, "0.78×")
    assert rows[f"packed+bf16w ≥ 1.5× {best} real tokens/s"] == (None, "not measured")
    assert rows["packed_after_liger ≥ 1.0× packed real tokens/s"] == (None, "not measured")
    assert rows["packed MFU ≥ 40 % (0.5b)"] == (None, "not measured")  # no MFU in the synthetic results
    assert rows["packed ≥ 1.2× hf_flatten real tokens/s"] == (True, "3.00×")
    assert rows["padded ≥ 0.97× hand_loop real tokens/s"] == (True, "1.02×")
    assert rows["token_budget real-token share ≥ 0.95"] == (True, "0.990")
    assert rows["packed peak memory, accumulation 4 ≤ 1.1× accumulation 1"] == (True, "1.05×")


def test_the_liger_in_process_ratio_and_mfu_where_measured(scripts):
    _, report = scripts
    results = synthetic()
    results["packed_after_liger"] = ran(2900.0, 820.0)
    results["packed"]["mfu"] = 0.41
    report.add_ratios(results)
    assert results["packed_after_liger"]["tokens_per_s_vs_packed"] == 2900.0 / 3000.0
    rows = {name: (passed, measured) for name, passed, measured in report.targets(results, 4, "0.5b")}
    assert rows["packed_after_liger ≥ 1.0× packed real tokens/s"] == (False, "0.97×")
    assert rows["packed MFU ≥ 40 % (0.5b)"] == (True, "41.0%")
    no_peers = {arm: r for arm, r in results.items() if arm in ("packed", "padded")}
    report.add_ratios(no_peers)
    assert no_peers["packed"]["best_peer_arm"] is None and no_peers["packed"]["tokens_per_s_vs_best_peer"] is None
    rows = {name: (passed, measured) for name, passed, measured in report.targets(no_peers)}
    assert rows["packed ≥ 1.5× best peer (None) real tokens/s"] == (None, "not measured")


def test_arm_names_say_what_each_configures(scripts):
    arms, _ = scripts
    arm = arms.parse("trl_packing+flex+liger+bf16w")
    assert (arm.base, arm.family, arm.attention, arm.liger, arm.bf16_weights) == (
        "trl_packing",
        "trl",
        "flex_attention",
        True,
        True,
    )
    assert arms.parse("hf_flatten_flash").attention == "flash_attention_2"  # the shipped name, kept
    assert arms.parse("packed+bf16w").configuration()["weights"] == "bfloat16"
    assert arms.parse("packed_after_liger").configuration()["liger"] is True
    for bad in ("packed+liger", "hf_flatten+flex+flash", "hand_loop+bf16w", "trl_packing+liger+liger", "nope"):
        with pytest.raises(ValueError):
            arms.parse(bad)


def test_the_tuned_set_on_a_cpu_runs_the_nearest_variants_and_lists_the_rest(scripts):
    arms, _ = scripts
    chosen, skipped = arms.arm_set(None, "tuned", cuda=False)
    names = [a.name for a in chosen]
    runnable = [n for n in names if n not in skipped]
    assert runnable == [  # the headline arms first: a run cut short by --time-limit keeps them
        "packed",
        "trl_packing",
        "trl_packing+bf16w",
        "trl_padding_free",
        "trl_padding_free+bf16w",
        "hf_flatten",
        "hf_flatten+bf16w",
        "packed+bf16w",
        "token_budget",
    ]
    assert skipped["packed_after_liger"] == LIGER_WHY
    assert skipped["trl_packing+flex+liger+bf16w"] == "flex_attention: torch's FlexAttention has no backward on a CPU"
    assert set(skipped) == {"packed_after_liger"} | {
        f"{base}{suffix}" for base in arms.PEERS for suffix in arms.TUNED_PEERS
    }
    with pytest.raises(ValueError, match="include hf_padded"):
        arms.arm_set("hand_loop,packed", "shipped", cuda=False)


def test_the_gpu_report_lists_each_arm_with_its_configuration_and_the_skipped_with_why(scripts):
    arms, report = scripts
    results = synthetic()
    for r in results.values():
        r["mfu"] = None
    report.add_ratios(results)
    for arm, r in results.items():
        r |= arms.parse(arm).configuration()
    step = {"name": "benchmark_0.5b", "figures": results, "command": "python scripts/benchmark.py --peers tuned"}
    lines = importlib.import_module("gpu_report")._benchmark(step)
    row = next(line for line in lines if line.startswith("| trl_packing+flex+liger |"))
    figures = "| 2500 | n/a | 900 | 1.00 | 1.00 | 2.50 | 1.00 | 1.000 | flex_attention; Liger; float32 |"
    assert row == "| trl_packing+flex+liger " + figures
    assert "- `packed_after_liger` skipped: Liger's Triton kernels need a CUDA device" in lines
    assert "- `trl_packing+flex+liger+bf16w` skipped: failed in its process (exit 1): RuntimeError: boom" in lines
    assert "ratios over the fastest peer (trl_packing+flex+liger)" in lines[2]
